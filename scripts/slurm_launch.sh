#!/usr/bin/env bash
# One torchrun per node through srun; shared by the scripts/slurm_*.sbatch jobs.
#
#   bash scripts/slurm_launch.sh pretrain_gpt.py FLAGS...      (inside an sbatch allocation)
#
# 1. The flags are validated once, here, before any worker starts (one error line, exit 2).
# 2. Every node runs one torchrun (c10d rendezvous at the first host of the job, so
#    --max-restarts restarts every node together from the last checkpoint). Global ranks are
#    contiguous per node (tensor-parallel groups stay inside a server).
# 3. SLURM's warning signal (sbatch --signal=B:USR1@300) reaches this shell, which forwards it to
#    the job steps (scancel --signal); torchrun passes it on to the trainers (--signals-to-handle, torch >= 2.9),
#    which save a checkpoint at the next step boundary and exit; torchrun waits SHUTDOWN_TIMEOUT s.
# 4. If the job got the warning signal (USR1), or the trainer exited 0 (e.g. --exit-duration-in-mins)
#    before --train-iters, and the checkpoint advanced, the job requeues itself (scontrol requeue) and
#    resumes from --load (= --save) when it starts again. After SIGTERM (scancel JOB, the time limit,
#    a preemption) the trainers save and the job ends without requeueing itself.
#
# Environment (defaults in brackets):
#   REPO               repository root [$SLURM_SUBMIT_DIR, else the current directory]
#   PYTHON             interpreter with megatron_2bw installed [$REPO/.venv/bin/python if present]
#   NPROC_PER_NODE     processes per node [GPUs on the node, else $CPU_PROCS_PER_NODE or 4]
#   MASTER_ADDR/PORT   rendezvous [first host of $SLURM_JOB_NODELIST, port 20000 + job id % 20000]
#   MAX_RESTARTS       torchrun --max-restarts: failed workers restart from the last checkpoint [3]
#   SHUTDOWN_TIMEOUT   seconds torchrun gives the trainers to save after a signal [240; < the sbatch --signal lead]
#   REQUEUE            1: requeue an unfinished, signalled job [1]; MAX_REQUEUES: at most [20] times
#   VALIDATE           1|0: run "SCRIPT FLAGS --validate-only" first [1]
#   VALIDATE_TIMEOUT   seconds the check may take before it is left to the trainers [20; 0: no limit]
#   NCCL_*             passed through; NCCL_DEBUG defaults to WARN, async error handling is on
#   GLOO_SOCKET_IFNAME interface of the step-statistics gloo group [the one this node routes to the other nodes by]
#   SRUN_ARGS          extra srun options, each written as --opt=value
set -euo pipefail

SCRIPT=${1:?usage: slurm_launch.sh pretrain_gpt.py|pretrain_bert.py FLAGS...}
shift
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$REPO"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NGPU=${SLURM_GPUS_ON_NODE:-}
  if [[ -z "$NGPU" ]]; then
    NGPU=$({ nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU' || true)
  fi
  if [[ "${NGPU:-0}" -gt 0 ]]; then NPROC_PER_NODE=$NGPU; else NPROC_PER_NODE=${CPU_PROCS_PER_NODE:-4}; fi
fi

if [[ -z "${MASTER_ADDR:-}" ]]; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR==1')
fi
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
MAX_RESTARTS=${MAX_RESTARTS:-3}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-240}
MAX_REQUEUES=${MAX_REQUEUES:-20}

# NCCL: report problems, fail fast on a dead peer instead of hanging in a collective.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# ---------------------------------------------------------------- flags: validate once, here
VALIDATE=${VALIDATE:-1}
if [[ "$VALIDATE" == 1 ]]; then
  # One process sees the whole world, so layout errors show here; it prints one line and exits 2.
  # Flag and file mistakes show within seconds; building the data indices of a long run can take
  # minutes, which the trainers do anyway: past VALIDATE_TIMEOUT (0: no limit) the rest is left to them.
  VRC=0
  RANK=0 LOCAL_RANK=0 WORLD_SIZE=$((NNODES * NPROC_PER_NODE)) timeout "${VALIDATE_TIMEOUT:-20}" "$PYTHON" "$SCRIPT" "$@" --validate-only || VRC=$?
  if [[ "$VRC" == 124 ]]; then
    echo "slurm_launch: --validate-only still busy after ${VALIDATE_TIMEOUT:-20} s (data indices): the trainers check the rest" >&2
  elif [[ "$VRC" != 0 ]]; then
    exit "$VRC"
  fi
fi

# --save and --train-iters decide whether an interrupted job requeues itself.
SAVE_DIR="" TRAIN_ITERS_ARG=""
prev=""
for a in "$@"; do
  case "$prev" in --save) SAVE_DIR=$a ;; --train-iters) TRAIN_ITERS_ARG=$a ;; esac
  case "$a" in --save=*) SAVE_DIR=${a#--save=} ;; --train-iters=*) TRAIN_ITERS_ARG=${a#--train-iters=} ;; esac
  prev=$a
done
latest_iteration() { cat "$SAVE_DIR/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0; }
START_ITER=$( [[ -n "$SAVE_DIR" ]] && latest_iteration || echo 0 )

echo "slurm_launch: $NNODES node(s) x $NPROC_PER_NODE process(es), rendezvous $MASTER_ADDR:$MASTER_PORT, $SCRIPT" \
     "(max restarts $MAX_RESTARTS)" >&2

# ---------------------------------------------------------------- signals: forward to the job steps
SIGNALLED=""
SRUN_PID=""
forward() {
  SIGNALLED=$1
  # a torchrun without --signals-to-handle (torch < 2.9) dies of SIGUSR1 and orphans its trainers; it
  # forwards SIGTERM, which --exit-signal-handler saves on as well
  if [[ "$1" == USR1 && -n "${TORCHRUN_SIGNAL_ARGS+x}" && "$TORCHRUN_SIGNAL_ARGS" != *--signals-to-handle* ]]; then
    echo "slurm_launch: this torchrun does not forward SIGUSR1: sending the steps SIGTERM" >&2
    set -- TERM
  fi
  echo "slurm_launch: received SIG$SIGNALLED: asking the trainers to save a checkpoint and exit" >&2
  if [[ -n "${SLURM_JOB_ID:-}" ]] && command -v scancel >/dev/null 2>&1; then
    scancel --signal="$1" "$SLURM_JOB_ID" 2>/dev/null && return 0
  fi
  [[ -n "$SRUN_PID" ]] && kill -s "$1" "$SRUN_PID" 2>/dev/null || true
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
trap 'forward HUP' HUP

# torchrun's signal flags, where this torch has them (launch_lib.sh); the same interpreter runs on every node.
source "$REPO/scripts/launch_lib.sh"
TORCHRUN_SIGNAL_ARGS=$(torchrun_signal_flags "$PYTHON" "$SHUTDOWN_TIMEOUT" slurm_launch | tr '\n' ' ')
# gloo (the world-wide step-statistics group) binds to the address its hostname resolves to unless
# GLOO_SOCKET_IFNAME names an interface; where that is a loopback or management address (a loopback alias in
# /etc/hosts is common) the cross-node connections fail at start-up. Default: the interface this (the
# first) node uses to reach the other nodes, for every node (set it where nodes name theirs differently).
# Its full mesh holds one socket per other rank: lift the open-file soft limit to the hard one.
if [[ -z "${GLOO_SOCKET_IFNAME:-}" ]]; then
  PEER=$( (( NNODES > 1 )) && scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR==2' || true)
  GLOO_SOCKET_IFNAME=$(route_ifname "$MASTER_ADDR" ${PEER:+"$PEER"})
fi
[[ -n "$GLOO_SOCKET_IFNAME" ]] && export GLOO_SOCKET_IFNAME
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
echo "slurm_launch: gloo interface ${GLOO_SOCKET_IFNAME:-(gloo's default: the hostname's address)}" >&2
# srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): without it the one task per node
# (torchrun and all its trainers) can be confined to one core. Give it the node's CPUs.
NODE_CPUS=${SLURM_JOB_CPUS_PER_NODE:+$(tr ',' '\n' <<<"$SLURM_JOB_CPUS_PER_NODE" | sed 's/(x[0-9]*)//' | sort -n | head -1)}
NODE_CPUS=${NODE_CPUS:-${SLURM_CPUS_ON_NODE:-}}

# Each task runs its own torchrun; the arguments travel as positional parameters (no quoting problems),
# the restart settings through the environment (srun exports it).
# scripts/graceful_torchrun.sh hands a stop signal to the workers rather than torchrun (no traceback).
# SLURM signals every process of a step (scancel --signal, preemption): SIGNALS_REACH_ALL=1 keeps torchrun
# out of it (no SignalException traceback in the job log; the trainers save and exit 0 on their own).
export RDZV_ID=${SLURM_JOB_ID:-local} MAX_RESTARTS SHUTDOWN_TIMEOUT TORCHRUN_SIGNAL_ARGS \
  GRACEFUL_TORCHRUN="$REPO/scripts/graceful_torchrun.sh" SIGNALS_REACH_ALL=${SIGNALS_REACH_ALL:-1}
# shellcheck disable=SC2086,SC2016
srun --kill-on-bad-exit=1 --nodes="$NNODES" --ntasks-per-node=1 --ntasks="$NNODES" \
  ${NODE_CPUS:+--cpus-per-task="$NODE_CPUS"} ${SRUN_ARGS:-} \
  bash -c 'exec bash "$GRACEFUL_TORCHRUN" "$0" -m torch.distributed.run --nnodes "$1" --nproc-per-node "$2" \
             --rdzv-backend c10d --rdzv-endpoint "$3:$4" --rdzv-id "$RDZV_ID" --max-restarts "$MAX_RESTARTS" \
             $TORCHRUN_SIGNAL_ARGS "${@:5}"' \
  "$PYTHON" "$NNODES" "$NPROC_PER_NODE" "$MASTER_ADDR" "$MASTER_PORT" "$SCRIPT" "$@" &
SRUN_PID=$!
RC=0
while :; do
  RC=0
  wait "$SRUN_PID" || RC=$?
  kill -0 "$SRUN_PID" 2>/dev/null || break  # else a trapped signal interrupted the wait: keep waiting
done

# ---------------------------------------------------------------- requeue an unfinished job
# Only the warning signal (USR1, sbatch --signal=B:USR1@...) requeues: SIGTERM/SIGHUP mean SLURM is ending the
# job (scancel JOB, the time limit itself, a preemption, which requeues by itself where PreemptMode=REQUEUE);
# the trainers save, the job ends, and a new job resumes from the checkpoint.
if [[ "${REQUEUE:-1}" == 1 && -n "${SLURM_JOB_ID:-}" && -n "$SAVE_DIR" && -n "$TRAIN_ITERS_ARG" ]] \
   && [[ "$SIGNALLED" == USR1 || ( -z "$SIGNALLED" && "$RC" == 0 ) ]]; then
  NOW_ITER=$(latest_iteration)
  if (( NOW_ITER >= TRAIN_ITERS_ARG )); then
    :
  elif (( NOW_ITER <= START_ITER )); then
    echo "slurm_launch: no checkpoint after iteration $START_ITER in this run: not requeueing" >&2
  elif (( ${SLURM_RESTART_COUNT:-0} >= MAX_REQUEUES )); then
    echo "slurm_launch: requeued $MAX_REQUEUES times already (MAX_REQUEUES): not again" >&2
  else
    echo "slurm_launch: checkpoint at iteration $NOW_ITER of $TRAIN_ITERS_ARG: requeueing job $SLURM_JOB_ID" >&2
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
fi
if [[ -n "$SIGNALLED" && "$SIGNALLED" != USR1 ]]; then
  echo "slurm_launch: stopped by SIG$SIGNALLED (scancel, the time limit or a preemption): not requeueing" >&2
fi
# A stop signal that the trainers answered with a checkpoint is a clean stop, whatever torchrun's status
# (a torchrun that received the signal itself exits 1).
if [[ -n "$SIGNALLED" && -n "$SAVE_DIR" && "$RC" != 0 ]] && (( $(latest_iteration) > START_ITER )); then
  echo "slurm_launch: the trainers saved iteration $(latest_iteration) after SIG$SIGNALLED: a clean stop (exit 0)" >&2
  exit 0
fi
exit "$RC"
