"""Bad input ends with one line ``error: ...``, a non-zero exit and no hang, before training starts.

Cases that need no processes run ``python pretrain_gpt.py ...`` with no launcher variables (or,
for layout checks that need a world size, ``WORLD_SIZE``/``RANK`` set as torchrun would but with
no peers: if validation came after ``init_process_group`` they would hang, and the timeout
would fail the test). Two cases run through torchrun with every rank failing the same way.
"""

from __future__ import annotations

import os

import pytest
from e2e import PY, REPO, clean_env, corpus, run, torchrun  # noqa: F401

TIMEOUT = 60


def base(c, *, drop: tuple[str, ...] = ()) -> list[str]:
    args = {
        "--model-preset": "gpt-tiny", "--micro-batch-size": "2", "--global-batch-size": "8", "--train-iters": "5",
        "--lr": "1e-3", "--device": "cpu",
    }
    out = [x for k, v in args.items() if k not in drop for x in (k, v)]
    return out + (c.data_args() if "--data-path" not in drop else
                  ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", c.model])


def fake_checkpoint(tmp, names: list[str], content: bytes = b"\x00garbage") -> str:
    root = tmp / "ckpt"
    for name in names:
        (root / "iter_0000003" / name).mkdir(parents=True)
        (root / "iter_0000003" / name / "model_optim_rng.pt").write_bytes(content)
    (root / "latest_checkpointed_iteration.txt").write_text("3\n")
    return str(root)


# (id, argv builder (corpus, tmp_path) -> argv, extra environment, expected text of the error line)
WORLD4 = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
CASES = [
    ("layers-vs-depth", lambda c, t: base(c) + ["--num-layers", "3", "--pipeline-model-parallel-size", "2"], {},
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    ("heads-vs-tensor", lambda c, t: base(c) + ["--tensor-model-parallel-size", "3"], {},
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    ("hidden-vs-heads", lambda c, t: base(c) + ["--hidden-size", "66"], {},
     "--hidden-size 66 is not divisible by --num-attention-heads 4"),
    ("global-batch", lambda c, t: base(c) + ["--global-batch-size", "7"], {},
     "--global-batch-size 7 is not divisible by --micro-batch-size 2 x data-parallel size 1"),
    ("2bw-m-below-d", lambda c, t: base(c) + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"],
     WORLD4, "PipeDream-2BW needs at least d microbatches per step: m=1 < d=2"),
    ("world-vs-layout", lambda c, t: base(c) + ["--pipeline-model-parallel-size", "2"], {**WORLD4, "WORLD_SIZE": "3"},
     "world size 3 is not divisible by tensor-model-parallel-size 1 x pipeline-model-parallel-size 2"),
    ("fp16-and-bf16", lambda c, t: base(c) + ["--fp16", "--bf16"], {}, "--fp16 and --bf16 are mutually exclusive"),
    ("schedule-spellings", lambda c, t: base(c) + ["--pipeline-schedule", "flush", "--gpipe"], {},
     "--gpipe contradicts --pipeline-schedule flush"),
    ("unknown-flag", lambda c, t: base(c) + ["--no-such-flag"], {},
     "unrecognized argument --no-such-flag (see --help)"),
    ("misspelt-flag", lambda c, t: base(c) + ["--micro-batch", "2"], {},
     "unrecognized argument --micro-batch (did you mean --micro-batch-size?)"),
    ("missing-train-iters", lambda c, t: base(c, drop=("--train-iters",)), {},
     "the following arguments are required: --train-iters"),
    ("bad-number", lambda c, t: base(c) + ["--lr", "fast"], {}, "argument --lr: invalid float value: 'fast'"),
    ("unknown-preset", lambda c, t: base(c) + ["--model-preset", "gpt-huge"], {}, "unknown --model-preset 'gpt-huge'"),
    ("bert-preset-for-gpt", lambda c, t: base(c) + ["--model-preset", "bert-tiny"], {},
     "--model-preset bert-tiny is a BERT model; use pretrain_bert.py"),
    ("min-lr-above-lr", lambda c, t: base(c) + ["--min-lr", "0.1"], {}, "--min-lr 0.1 must be in [0, --lr 0.001]"),
    ("warmup-too-long", lambda c, t: base(c) + ["--lr-warmup-iters", "10"], {},
     "--lr-warmup-iters 10 exceeds the decay iterations 5"),
    ("positions-below-seq", lambda c, t: base(c) + ["--max-position-embeddings", "8"], {},
     "--max-position-embeddings 8 is smaller than --seq-length 16"),
    ("nccl-on-cpu", lambda c, t: base(c) + ["--distributed-backend", "nccl"], {},
     "--distributed-backend nccl needs --device cuda"),
    ("save-interval-without-save", lambda c, t: base(c) + ["--save-interval", "2"], {},
     "--save-interval needs --save DIR"),
    ("no-data-path", lambda c, t: base(c, drop=("--data-path",)), {}, "--data-path is required"),
    ("odd-blend", lambda c, t: base(c) + ["--data-path", "0.5", c.prefix, "0.5"], {}, "an odd number"),
    ("split-all-zero", lambda c, t: base(c) + ["--split", "0,0,0"], {}, "--split '0,0,0' is all zeros"),
    ("missing-data", lambda c, t: base(c) + ["--data-path", str(t / "nowhere")], {}, "nowhere.idx"),
    ("missing-tokenizer", lambda c, t: base(c) + ["--tokenizer-model", str(t / "tok.model")], {},
     "tok.model does not exist"),
    ("vocab-vs-data", lambda c, t: base(c) + ["--tokenizer-model", c.small_model], {},
     "was made with SentencePieceTokenizer, vocabulary 512"),  # its sidecar (data/fingerprint.py), before any id
    ("load-without-checkpoint", lambda c, t: base(c) + ["--load", str(t)], {}, "holds no checkpoint"),
    ("corrupt-checkpoint", lambda c, t: base(c) + ["--load", fake_checkpoint(t, ["mp_rank_00"])], {},
     "is corrupt or unreadable"),
    # every number checked at start-up (issue 11), each blamed on its own flag
    ("train-iters-0", lambda c, t: base(c) + ["--train-iters", "0"], {}, "--train-iters must be >= 1, got 0"),
    ("train-iters-negative", lambda c, t: base(c) + ["--train-iters", "-5"], {}, "--train-iters must be >= 1, got -5"),
    ("lr-inf", lambda c, t: base(c) + ["--lr", "inf"], {}, "--lr must be a finite number, got inf"),
    ("lr-nan", lambda c, t: base(c) + ["--lr", "nan"], {}, "--lr must be a finite number, got nan"),
    ("weight-decay-negative", lambda c, t: base(c) + ["--weight-decay", "-1"], {}, "--weight-decay must be >= 0"),
    ("adam-eps-0", lambda c, t: base(c) + ["--adam-eps", "0"], {}, "--adam-eps must be positive"),
    ("min-loss-scale-negative", lambda c, t: base(c) + ["--fp16", "--min-loss-scale", "-1"], {},
     "--min-loss-scale must be positive, got -1.0"),
    ("loss-scale-window-0", lambda c, t: base(c) + ["--fp16", "--loss-scale-window", "0"], {},
     "--loss-scale-window must be >= 1, got 0"),
    ("initial-loss-scale-0", lambda c, t: base(c) + ["--fp16", "--initial-loss-scale", "0"], {},
     "--initial-loss-scale must be positive, got 0.0"),
    ("constant-loss-scale-overflows", lambda c, t: base(c) + ["--fp16", "--loss-scale", "1e30"], {},
     "--loss-scale 1e+30 is above fp16's largest value 65504"),
    ("seed-negative", lambda c, t: base(c) + ["--seed", "-1"], {}, "--seed must be in [0, 2**32 - 1]"),
    ("seed-too-big", lambda c, t: base(c) + ["--seed", str(2**32)], {}, f"--seed must be in [0, 2**32 - 1] "
     f"(numpy seeds the data order), got {2**32}"),
    ("load-is-a-file", lambda c, t: base(c) + ["--load", c.model], {},
     "is a file; it must name a checkpoint directory"),
    ("save-under-a-file", lambda c, t: base(c) + ["--save", os.path.join(c.model, "ckpt")], {},
     ", which is a file, not a directory"),
    ("checkpoint-layout", lambda c, t: base(c) + ["--load", fake_checkpoint(t, ["mp_rank_00_000", "mp_rank_00_001"])],
     {}, "was saved with layout t=1 d=2 (tensor x pipeline) but this run uses t=1 d=1"),
]


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(case, corpus, tmp_path):  # noqa: F811
    _, build, env, expected = case
    res = run([PY, os.path.join(REPO, "pretrain_gpt.py"), *build(corpus, tmp_path)], env=clean_env(**env),
              timeout=TIMEOUT)
    assert res.returncode == 2, res.describe()
    assert "Traceback" not in res.stderr, res.describe()
    line = _error_line(res.stderr)
    assert line.startswith("error: ") and expected in line, res.describe()


def test_case_table_is_large_enough():
    assert len(CASES) >= 15


def test_torchrun_every_rank_refuses_before_init(corpus):  # noqa: F811
    """4 processes, d = 2, B = 4: m = 1 < d on every rank; all exit 2 at once, nobody waits for a peer."""
    res = torchrun("pretrain_gpt.py",
                   base(corpus) + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"],
                   nproc=4, timeout=TIMEOUT, real=True)
    assert res.returncode != 0, res.describe()
    # one line for the 4 ranks, and torchrun ended before its ChildFailedError traceback (issue 19)
    assert res.stderr.count("error: PipeDream-2BW needs at least d microbatches per step: m=1 < d=2") == 1
    assert "pretrain_gpt.py FAILED" not in res.stderr and "Traceback" not in res.stderr, res.describe()
    assert "megatron_2bw/" not in res.stderr, res.describe()  # no traceback from our code


def test_torchrun_missing_data(corpus, tmp_path):  # noqa: F811
    res = torchrun("pretrain_bert.py", ["--model-preset", "bert-tiny", "--micro-batch-size", "2", "--train-iters", "5",
                                        "--lr", "1e-3", "--device", "cpu", *corpus.data_args(),
                                        "--data-path", str(tmp_path / "missing")], nproc=2, timeout=TIMEOUT, real=True)
    assert res.returncode != 0, res.describe()
    assert "error: --data-path" in res.stderr and "missing.idx" in res.stderr, res.describe()
    assert "megatron_2bw/" not in res.stderr, res.describe()
