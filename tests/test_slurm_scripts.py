"""The launch scripts: syntax, no hard-coded site details, and the command line each job builds for the
allocation its #SBATCH lines ask for (4 nodes x 8 GPUs, which no machine here has). The jobs run for real
under a real SLURM in tests/test_slurm_jobs.py."""

from __future__ import annotations

import glob
import os
import re
import stat

import pytest
from e2e import PY, REPO, clean_env, run

SCRIPTS = sorted(glob.glob(os.path.join(REPO, "scripts", "*.sh"))
                 + glob.glob(os.path.join(REPO, "scripts", "*.sbatch")))


@pytest.mark.parametrize("path", SCRIPTS, ids=[os.path.basename(p) for p in SCRIPTS])
def test_script_syntax_and_no_site_details(path):
    res = run(["bash", "-n", path], timeout=30)
    assert res.returncode == 0, res.describe()
    text = open(path, encoding="utf-8").read()
    assert not re.search(r"/home/|/Users/|ssh-rsa|AKIA[0-9A-Z]{8}|\b\d{1,3}(\.\d{1,3}){3}\b", text)


def _sbatch_directives(path: str) -> dict[str, str]:
    """The ``#SBATCH --key=value`` options of a job script (what sbatch itself would read)."""
    out = {}
    for line in open(path, encoding="utf-8"):
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


def _recording_slurm(tmp_path) -> tuple[str, str]:
    """Stand-in ``scontrol`` (the job's first host is node01) and ``srun`` that records its argv (NUL-separated)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    argv = tmp_path / "srun.argv"
    _stub(bin_dir / "scontrol", '[[ "$1 $2" == "show hostnames" ]] && echo node01\n')
    _stub(bin_dir / "srun", f'printf "%s\\0" "$@" > {argv}\n')
    return str(bin_dir), str(argv)


SBATCH = [p for p in SCRIPTS if p.endswith(".sbatch")]


@pytest.mark.parametrize("path", SBATCH, ids=[os.path.basename(p) for p in SBATCH])
def test_sbatch_job_launches_a_run_the_trainer_accepts(path, tmp_path):
    """Each job's default command, as srun receives it, parses with the trainer's own parser into a
    valid run for the allocation its #SBATCH lines ask for, with the schedule its name says."""
    from megatron_2bw.cli import build_config, build_parser

    opts = _sbatch_directives(path)
    nodes, gpus = int(opts["nodes"]), int(opts["gpus-per-node"])
    bin_dir, argv_file = _recording_slurm(tmp_path)
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node[01-04]",
                    SLURM_NNODES=str(nodes), SLURM_GPUS_ON_NODE=str(gpus), SLURM_SUBMIT_DIR=REPO, PYTHON=PY,
                    VALIDATE="0")  # the default data (demo_data/) needs `make demo`; the argv is checked below instead
    res = run(["bash", path], env=env, cwd=str(tmp_path), timeout=60)
    assert res.returncode == 0, res.describe()
    argv = open(argv_file, encoding="utf-8").read().split("\0")[:-1]
    cmd = argv.index("bash")
    srun_opts, (python, nnodes, nproc, addr, port, script, *flags) = argv[:cmd], argv[cmd + 3:]
    assert "--kill-on-bad-exit=1" in srun_opts and f"--nodes={nodes}" in srun_opts
    assert (python, int(nnodes), int(nproc), addr, int(port)) == (PY, nodes, gpus, "node01", 20000 + 4242)
    _, kind, schedule = os.path.basename(path)[: -len(".sbatch")].split("_")
    assert script == f"pretrain_{kind}.py"
    cfg = build_config(build_parser(kind).parse_args(flags), kind, nodes * gpus, cuda_available=True)
    assert cfg.pipeline.schedule == schedule
    assert cfg.parallel.tensor * cfg.parallel.pipeline * cfg.parallel.data == nodes * gpus


def _stub(path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
