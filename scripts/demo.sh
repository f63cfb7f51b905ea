#!/usr/bin/env bash
# The README's first command (`make demo`): train a small GPT (~5M parameters, preset gpt-demo)
# with PipeDream-2BW on a corpus built from the Python standard library's own documentation.
#
# CPU: 4 processes, pipeline depth d=2 x data width w=2 (gloo). GPUs: one process per GPU
# (d=2 with 2+ GPUs, d=1 with one). The corpus, the SentencePiece tokenizer and the indexed
# dataset are cached under demo_data/ (git-ignored), so a second run starts training at once.
#
# Environment: PYTHON, MODEL (preset: gpt-demo; llama-demo for the Llama-style model), DEMO_DATA (demo_data),
# DEMO_VOCAB (8000), DEMO_ITERS (CPU 150, GPU 500), DEMO_SEQ (CPU 64, GPU 128), DEMO_MICRO (CPU 2, GPU 8), NGPU (detected), DEMO_RUN (runs/demo),
# DEMO_ARGS (extra flags). The learning-rate warm-up is 10 steps, DEMO_ITERS / 15 when that is fewer.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
DATA=${DEMO_DATA:-demo_data}
MODEL=${MODEL:-gpt-demo}
VOCAB=${DEMO_VOCAB:-8000}
mkdir -p "$DATA"
START=$(date +%s)

if [[ ! -s "$DATA/corpus.jsonl" ]]; then
  "$PYTHON" tools/build_demo_corpus.py --output "$DATA/corpus.jsonl.tmp" --max-mb 4
  mv "$DATA/corpus.jsonl.tmp" "$DATA/corpus.jsonl"
fi
if [[ ! -s "$DATA/tok_$VOCAB.model" ]]; then
  "$PYTHON" tools/train_tokenizer.py --input "$DATA/corpus.jsonl" --vocab-size "$VOCAB" --model-prefix "$DATA/tok_$VOCAB"
fi
PREFIX="$DATA/demo_$VOCAB"
if [[ ! -s "${PREFIX}_text_document.idx" ]]; then
  "$PYTHON" tools/preprocess_data.py --input "$DATA/corpus.jsonl" --output-prefix "$PREFIX" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tok_$VOCAB.model" --append-eod
fi

source scripts/launch_lib.sh
NGPU=${NGPU:-$(gpu_count "$PYTHON")}
if [[ "$NGPU" -ge 2 ]]; then
  NPROC=$(( NGPU / 2 * 2 )); PP=2; DEVICE=cuda
elif [[ "$NGPU" -eq 1 ]]; then
  NPROC=1; PP=1; DEVICE=cuda
else
  NPROC=4; PP=2; DEVICE=cpu
fi
W=$(( NPROC / PP ))
if [[ "$DEVICE" == cuda ]]; then
  ITERS=${DEMO_ITERS:-500}; SEQ=${DEMO_SEQ:-128}; MICRO=${DEMO_MICRO:-8}
else
  ITERS=${DEMO_ITERS:-150}; SEQ=${DEMO_SEQ:-64}; MICRO=${DEMO_MICRO:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
GLOBAL=$(( MICRO * W * 4 ))  # m = 4 microbatches per step per pipeline (2BW needs m >= d)
WARMUP=$(( ITERS / 15 < 10 ? ITERS / 15 : 10 ))  # 10 steps, fewer in a short run (it must not exceed ITERS)
RUN=${DEMO_RUN:-runs/demo}
mkdir -p "$RUN"
rm -f "$RUN/metrics.jsonl"
echo "demo: data ready in $(( $(date +%s) - START )) s; training $MODEL with PipeDream-2BW," \
     "$NPROC process(es) on $DEVICE (d=$PP, w=$W), $ITERS steps of $GLOBAL sequences x $SEQ tokens" >&2

# shellcheck disable=SC2086
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  --model-preset "$MODEL" --seq-length "$SEQ" --device "$DEVICE" \
  --pipeline-model-parallel-size "$PP" --pipeline-schedule 2bw \
  --micro-batch-size "$MICRO" --global-batch-size "$GLOBAL" --train-iters "$ITERS" \
  --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" --weight-decay 0.01 --clip-grad 1.0 \
  --data-path "${PREFIX}_text_document" --split 98,2,0 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tok_$VOCAB.model" \
  --log-interval 10 --eval-interval "$ITERS" --eval-iters 4 \
  --metrics-file "$RUN/metrics.jsonl" ${DEMO_ARGS:-}

"$PYTHON" - "$RUN/metrics.jsonl" "$START" <<'PY'
import json, sys, time
rows = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in rows if r["type"] == "train"]
first, last = train[:5], train[-5:]
mean = lambda rs: sum(r["loss"] for r in rs) / len(rs)
evals = [r for r in rows if r["type"] == "eval"]
print(f"demo: loss {mean(first):.3f} (first 5 steps) -> {mean(last):.3f} (last 5 steps) over {len(train)} steps"
      + (f"; validation loss {evals[-1]['loss']:.3f}" if evals else "")
      + f"; {time.time() - float(sys.argv[2]):.0f} s in all. Metrics: {sys.argv[1]}")
PY
