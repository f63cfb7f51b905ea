#!/usr/bin/env bash
# Train on one machine: one process per GPU, or CPU processes (gloo) when there is no GPU.
#
#   scripts/run_local.sh pretrain_gpt.py --model-preset gpt-demo --pipeline-model-parallel-size 2 ...
#
# Environment: PYTHON (default .venv/bin/python if present, else python3), NPROC (default: the GPU
# count, else 4), DEVICE (default: cuda with GPUs, else cpu), OMP_NUM_THREADS (CPU: cores / NPROC).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
SCRIPT=${1:?usage: scripts/run_local.sh pretrain_gpt.py|pretrain_bert.py FLAGS...}
shift

NGPU=${NGPU:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}
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

echo "run_local: $NPROC process(es) on $DEVICE" >&2
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$SCRIPT" --device "$DEVICE" "$@"
