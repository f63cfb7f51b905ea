"""The launch scripts: syntax, no hard-coded site details, and one SLURM job run for real on this
machine with stand-in ``srun``/``scontrol`` (one node, CPU processes)."""

from __future__ import annotations

import glob
import os
import re
import stat

import pytest

from e2e import PY, REPO, clean_env, corpus, free_port, read_metrics, run  # noqa: F401

SCRIPTS = sorted(glob.glob(os.path.join(REPO, "scripts", "*.sh")) + glob.glob(os.path.join(REPO, "scripts", "*.sbatch")))


@pytest.mark.parametrize("path", SCRIPTS, ids=[os.path.basename(p) for p in SCRIPTS])
def test_script_syntax_and_no_site_details(path):
    res = run(["bash", "-n", path], timeout=30)
    assert res.returncode == 0, res.describe()
    text = open(path, encoding="utf-8").read()
    assert not re.search(r"/home/|/Users/|ssh-rsa|AKIA[0-9A-Z]{8}|\b\d{1,3}(\.\d{1,3}){3}\b", text)


def test_sbatch_scripts_exist():
    names = {os.path.basename(p) for p in SCRIPTS}
    assert {"slurm_gpt_2bw.sbatch", "slurm_gpt_flush.sbatch", "slurm_bert_2bw.sbatch", "run_local.sh",
            "demo.sh", "slurm_launch.sh"} <= names
    for name in ("slurm_gpt_2bw.sbatch", "slurm_gpt_flush.sbatch", "slurm_bert_2bw.sbatch"):
        text = open(os.path.join(REPO, "scripts", name), encoding="utf-8").read()
        assert "#SBATCH --nodes=" in text and "slurm_launch.sh" in text
    launch = open(os.path.join(REPO, "scripts", "slurm_launch.sh"), encoding="utf-8").read()
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in launch
    assert "srun --kill-on-bad-exit=1" in launch and "NCCL_DEBUG" in launch


def _stub(path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_sbatch_job_runs_with_stand_in_slurm(corpus, tmp_path):  # noqa: F811
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    _stub(bin_dir / "scontrol", f'echo "scontrol $*" >> {calls}\n'
                                '[[ "$1 $2" == "show hostnames" ]] && echo localhost\n')
    _stub(bin_dir / "srun", f'echo "srun $*" >> {calls}\n'
                            'while [[ $# -gt 0 && "$1" == -* ]]; do shift; done\n'
                            'export SLURM_PROCID=0 SLURM_NODEID=0 SLURM_LOCALID=0 SLURM_NTASKS=1\n'
                            'exec "$@"\n')
    save = tmp_path / "ckpt"
    env = clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node[01]",
        SLURM_NNODES="1", SLURM_SUBMIT_DIR=REPO, PYTHON=PY, NPROC_PER_NODE="2", MASTER_PORT=str(free_port()),
        MODEL_ARGS="--model-preset gpt-tiny", PRECISION_ARGS="", EXTRA_ARGS="", TP="1", PP="2", MICRO_BATCH="2",
        GLOBAL_BATCH="4", TRAIN_ITERS="4", LR="1e-3", MIN_LR="1e-4", WARMUP_ITERS="1", DATA_PATH=corpus.prefix,
        SPLIT="90,5,5", TOKENIZER_ARGS=f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {corpus.model}",
        SAVE=str(save), SAVE_INTERVAL="2", LOG_INTERVAL="2", EVAL_INTERVAL="4", EVAL_ITERS="1", DEVICE="cpu",
    )
    res = run(["bash", os.path.join(REPO, "scripts", "slurm_gpt_flush.sbatch")], env=env, cwd=str(tmp_path), timeout=180)
    assert res.returncode == 0, res.describe()
    log = calls.read_text()
    assert "scontrol show hostnames node[01]" in log and "srun --kill-on-bad-exit=1" in log
    assert "rendezvous localhost:" in res.stderr and "layout t=1 d=2 w=1 (2 processes" in res.stderr
    records = read_metrics(str(save / "metrics.jsonl"))
    assert [r["iteration"] for r in records if r["type"] == "train"] == [0, 1, 2, 3]
    assert records[0]["schedule"] == "flush"
    assert sorted(os.listdir(save / "iter_0000004")) == ["mp_rank_00_000", "mp_rank_00_001"]
