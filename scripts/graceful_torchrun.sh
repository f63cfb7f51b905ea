#!/usr/bin/env bash
# Run torchrun so that a stop signal saves and exits 0, without torchrun's traceback:
#
#   scripts/graceful_torchrun.sh PYTHON -m torch.distributed.run TORCHRUN_FLAGS... SCRIPT FLAGS...
#
# torchrun that receives SIGTERM/SIGINT/SIGHUP/SIGUSR1 itself raises SignalException: it prints a
# 30-line traceback and exits 1 even when every worker saved a checkpoint and exited 0, so a wrapper
# cannot tell a clean stop from a crash. Here torchrun runs in its own process group (a terminal's
# Ctrl-C reaches this shell only) and the first stop signal goes to its workers instead: they save at
# the next step boundary and exit 0 (the trainer's exit signal handler, on by default), and torchrun
# then ends as after a finished run, with exit 0. Before any worker exists, or on a second signal, the
# signal goes to torchrun itself (it tears the workers down), and so does every signal when the
# command line says --no-exit-signal-handler (the workers would die and torchrun restart them).
# torchrun dies with this shell (setpriv --pdeathsig KILL where available; its workers die with it),
# as it did under exec.
#
# Under SLURM (SIGNALS_REACH_ALL=1, set by slurm_launch.sh) a stop signal (scancel, preemption, the
# time-limit warning) reaches every process of the step, torchrun included, not this shell alone: there
# torchrun starts with SIGTERM/SIGINT/SIGHUP/SIGUSR1 ignored and handles SIGQUIT only
# (--signals-to-handle, torch >= 2.9), so it raises no SignalException and prints no traceback; the
# trainers handle the signals themselves, save and exit 0, and torchrun ends as after a finished run.
#
# A start-up error that a worker reports under torchrun (one "error:" line; it then ends torchrun,
# megatron_2bw/training/launcher_errors.py) ends this script with status 2, as --validate-only does,
# not with the status of torchrun's end by a signal.
set -uo pipefail
[[ $# -gt 0 ]] || { echo "usage: graceful_torchrun.sh PYTHON -m torch.distributed.run ..." >&2; exit 2; }
PDEATH=()
if command -v setpriv >/dev/null 2>&1 && setpriv --pdeathsig KILL true 2>/dev/null; then
  PDEATH=(setpriv --pdeathsig KILL --)
fi
STOPS=0
for a in "$@"; do [[ "$a" == --no-exit-signal-handler ]] && STOPS=1; done
IGNORE=()
if [[ "${SIGNALS_REACH_ALL:-0}" == 1 && "$STOPS" == 0 ]]; then
  IGNORE=(TERM INT HUP USR1)
  ARGS=()
  prev=""
  for a in "$@"; do
    if [[ "$prev" == --signals-to-handle ]]; then ARGS+=(SIGQUIT); else ARGS+=("$a"); fi
    prev=$a
  done
  set -- "${ARGS[@]}"
fi
ERROR_FILE=$(mktemp "${TMPDIR:-/tmp}/graceful_torchrun.XXXXXX")
export MEGATRON_2BW_STARTUP_ERROR_FILE=$ERROR_FILE
set -m  # the background job below gets its own process group
( if (( ${#IGNORE[@]} )); then trap '' "${IGNORE[@]}"; fi; exec "${PDEATH[@]}" "$@" ) &
TORCHRUN=$!
set +m
workers() {  # torchrun's children: the trainers
  if command -v pgrep >/dev/null 2>&1; then pgrep -P "$TORCHRUN" 2>/dev/null || true
  else ps -o pid= --ppid "$TORCHRUN" 2>/dev/null || true; fi
}
stop() {
  STOPS=$((STOPS + 1))
  local pids
  pids=$(workers)
  if (( STOPS == 1 )) && [[ -n "$pids" ]]; then
    # shellcheck disable=SC2086
    kill -s "$1" $pids 2>/dev/null || true
  else
    kill -s "$1" "$TORCHRUN" 2>/dev/null || true
  fi
}
for sig in TERM INT HUP USR1; do trap "stop $sig" "$sig"; done

RC=0
while :; do
  RC=0
  wait "$TORCHRUN" 2>/dev/null || RC=$?  # (bash's "User defined signal 2" job notice: the error line says it)
  kill -0 "$TORCHRUN" 2>/dev/null || break  # else a trapped signal interrupted the wait: keep waiting
done
if [[ "$RC" != 0 && -s "$ERROR_FILE" ]]; then
  RC=2  # a worker printed the start-up error and ended torchrun
fi
rm -f "$ERROR_FILE"
exit "$RC"
