#!/usr/bin/env bash
# One torchrun per node through srun; shared by the scripts/slurm_*.sbatch jobs.
#
#   bash scripts/slurm_launch.sh pretrain_gpt.py FLAGS...      (inside an sbatch allocation)
#
# The first host of the job is the rendezvous address; every node runs one torchrun with its
# SLURM node id as --node-rank, so global ranks are contiguous per node (tensor-parallel
# groups stay inside a server). Everything is overridable by environment variables:
#   REPO               repository root (default: $SLURM_SUBMIT_DIR, else the current directory)
#   PYTHON             interpreter with megatron_2bw installed (default: $REPO/.venv/bin/python if present)
#   NPROC_PER_NODE     processes per node (default: GPUs on the node, else $CPU_PROCS_PER_NODE or 4)
#   MASTER_ADDR/PORT   rendezvous (default: first host of $SLURM_JOB_NODELIST, port 20000 + job id % 20000)
#   NCCL_*             passed through; NCCL_DEBUG defaults to WARN, async error handling is on
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
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
fi
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}

# NCCL: report problems, fail fast on a dead peer instead of hanging in a collective.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

echo "slurm_launch: $NNODES node(s) x $NPROC_PER_NODE process(es), rendezvous $MASTER_ADDR:$MASTER_PORT, $SCRIPT" >&2

# Each task expands its own $SLURM_NODEID, so the torchrun command goes through bash -c;
# the arguments travel as positional parameters (no quoting problems).
# shellcheck disable=SC2086,SC2016
srun --kill-on-bad-exit=1 --nodes="$NNODES" --ntasks-per-node=1 --ntasks="$NNODES" ${SRUN_ARGS:-} \
  bash -c 'exec "$0" -m torch.distributed.run --nnodes "$1" --nproc-per-node "$2" --node-rank "$SLURM_NODEID" \
             --master-addr "$3" --master-port "$4" "${@:5}"' \
  "$PYTHON" "$NNODES" "$NPROC_PER_NODE" "$MASTER_ADDR" "$MASTER_PORT" "$SCRIPT" "$@"
