#!/usr/bin/env bash
# Train on one machine: one process per GPU, or CPU processes (gloo) when there is no GPU.
#
#   scripts/run_local.sh pretrain_gpt.py --model-preset gpt-demo --pipeline-model-parallel-size 2 ...
#
# The flags are validated once before any worker starts (one error line, exit 2). torchrun
# restarts failed workers up to MAX_RESTARTS times; pass --load equal to --save so a restart
# resumes from the last checkpoint. Ctrl-C, or SIGTERM/SIGHUP/SIGUSR1 to this script, reaches every
# worker (scripts/graceful_torchrun.sh): they save a checkpoint at the next step boundary and exit, and
# the script exits 0 without torchrun's traceback (--no-exit-signal-handler: they stop at once).
#
# Environment: PYTHON (default .venv/bin/python if present, else python3), NPROC (default: the GPU
# count, else 4), DEVICE (default: cuda with GPUs, else cpu), OMP_NUM_THREADS (CPU: cores / NPROC),
# MAX_RESTARTS (torchrun --max-restarts, default 3), SHUTDOWN_TIMEOUT (seconds torchrun waits for
# workers to save after a signal, default 120; torchrun's signal flags are passed only where this torch
# has them, see launch_lib.sh), VALIDATE (1|0: run "SCRIPT FLAGS --validate-only"
# first), VALIDATE_TIMEOUT (seconds that check may take
# before the rest is left to the trainers, default 20; 0: no limit).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
SCRIPT=${1:?usage: scripts/run_local.sh pretrain_gpt.py|pretrain_bert.py FLAGS...}
shift

source scripts/launch_lib.sh
NGPU=${NGPU:-$(gpu_count "$PYTHON")}
if [[ "$NGPU" -gt 0 ]]; then
  DEVICE=${DEVICE:-cuda}
  NPROC=${NPROC:-$NGPU}
else
  DEVICE=${DEVICE:-cpu}
  NPROC=${NPROC:-4}
fi
if [[ "$DEVICE" == cpu && -z "${OMP_NUM_THREADS:-}" ]]; then
  CORES=$(nproc 2>/dev/null || echo 1)
  export OMP_NUM_THREADS=$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))
fi
MAX_RESTARTS=${MAX_RESTARTS:-3}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-120}

VALIDATE=${VALIDATE:-1}
if [[ "$VALIDATE" == 1 ]]; then
  # One process sees the whole world, so layout errors show here; it prints one line and exits 2.
  # Flag and file mistakes show within seconds; building the data indices of a long run can take
  # minutes, which the trainers do anyway: past VALIDATE_TIMEOUT (0: no limit) the rest is left to them.
  VRC=0
  RANK=0 LOCAL_RANK=0 WORLD_SIZE="$NPROC" MEGATRON_2BW_VALIDATE_QUIET=1 timeout "${VALIDATE_TIMEOUT:-20}" "$PYTHON" "$SCRIPT" --device "$DEVICE" "$@" --validate-only || VRC=$?
  if [[ "$VRC" == 124 ]]; then
    echo "run_local: --validate-only still busy after ${VALIDATE_TIMEOUT:-20} s (data indices): the trainers check the rest" >&2
  elif [[ "$VRC" != 0 ]]; then
    exit "$VRC"
  fi
fi

mapfile -t SIGNAL_ARGS < <(torchrun_signal_flags "$PYTHON" "$SHUTDOWN_TIMEOUT" run_local)  # what this torch accepts

echo "run_local: $NPROC process(es) on $DEVICE (max restarts $MAX_RESTARTS)" >&2
exec bash scripts/graceful_torchrun.sh "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  --max-restarts "$MAX_RESTARTS" ${SIGNAL_ARGS[@]+"${SIGNAL_ARGS[@]}"} "$SCRIPT" --device "$DEVICE" "$@"
