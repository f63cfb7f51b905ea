"""Pre-train GPT with PipeDream-2BW, PipeDream-Flush or GPipe, Megatron-LM's flags.

The schedule defaults to 2BW with several pipeline stages and to Flush with one.

    torchrun --nproc-per-node 4 pretrain_gpt.py --model-preset gpt-demo --pipeline-model-parallel-size 2 \\
        --micro-batch-size 4 --global-batch-size 16 --train-iters 200 --lr 1e-3 --device cpu \\
        --data-path demo_data/demo_8000_text_document --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model demo_data/tok_8000.model

See docs/training.md for every flag, the metrics file and the checkpoint layout.
"""

import sys

from megatron_2bw.training.launch import main

if __name__ == "__main__":
    sys.exit(main("gpt"))
