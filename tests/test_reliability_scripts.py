"""The launch scripts' reliability logic, run for real with stand-in python/srun/scontrol/scancel on PATH:
validation once before any worker, torchrun restarts and signal forwarding, SLURM's warning signal reaching
the trainer, and the requeue decision."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import time

import pytest
from e2e import REPO, clean_env

SBATCH = ["slurm_gpt_2bw.sbatch", "slurm_gpt_flush.sbatch", "slurm_bert_2bw.sbatch"]

# A stand-in interpreter: "-m torch.distributed.run --help" prints $FAKE_TORCHRUN_HELP (torchrun's flags;
# a flag it does not list is refused when passed); --help prints $FAKE_HELP; "--validate-only" fails when
# $FAKE_INVALID is set; "-m torch.distributed.run" plays the trainer ($FAKE_TRAIN: ok | crash | wait_signal).
# Every call is logged.
_FAKE_PY = r"""#!/usr/bin/env bash
if [[ "$*" == "-m torch.distributed.run --help" ]]; then printf '%s\n' "$FAKE_TORCHRUN_HELP"; exit 0; fi
printf '%s\0' "$@" >> "$FAKE_DIR/calls"; printf '\n' >> "$FAKE_DIR/calls"
env | grep -E '^(RANK|WORLD_SIZE|LOCAL_RANK)=' | sort | tr '\n' ' ' >> "$FAKE_DIR/envs"; echo >> "$FAKE_DIR/envs"
if [[ "$1" == -m ]]; then
  echo "${GLOO_SOCKET_IFNAME-unset}" > "$FAKE_DIR/gloo"
  for a in "$@"; do  # a torchrun refuses the flags its --help does not list, as argparse does
    case "$a" in --signals-to-handle|--shutdown-timeout)
      grep -q -- "$a" <<<"$FAKE_TORCHRUN_HELP" || { echo "torchrun: error: unrecognized arguments: $a" >&2; exit 2; } ;;
    esac
  done
  case "${FAKE_TRAIN:-ok}" in
    ok) exit 0 ;;
    crash) echo "error: rank 1: training failed" >&2; exit 1 ;;
    wait_signal)
      on_signal() {
        echo "trainer: got $1" >&2; echo "$FAKE_SAVED_ITER" > "$FAKE_SAVE/latest_checkpointed_iteration.txt"
        exit "${FAKE_SIGNAL_RC:-1}"
      }
      trap 'on_signal USR1' USR1; trap 'on_signal TERM' TERM
      echo $$ > "$FAKE_DIR/trainer.pid"
      for _ in $(seq 600); do sleep 0.1; done; exit 9 ;;
  esac
fi
for a in "$@"; do
  if [[ "$a" == --help ]]; then printf '%s\n' "$FAKE_HELP"; exit 0; fi
  if [[ "$a" == --validate-only && -n "${FAKE_INVALID:-}" ]]; then echo "error: $FAKE_INVALID" >&2; exit 2; fi
  if [[ "$a" == --validate-only && -n "${FAKE_VALIDATE_SLEEP:-}" ]]; then sleep "$FAKE_VALIDATE_SLEEP"; fi
done
exit 0
"""
_SRUN = r"""#!/usr/bin/env bash
printf '%s\0' "$@" > "$FAKE_DIR/srun.argv"
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done
exec "$@"
"""
_SCONTROL = r"""#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_DIR/slurm.log"
[[ "$1 $2" == "show hostnames" ]] && printf 'node01\nnode02\n'
exit 0
"""
# scancel --signal=SIG JOB: deliver SIG to the job step (here: the stand-in trainer).
_SCANCEL = r"""#!/usr/bin/env bash
echo "scancel $*" >> "$FAKE_DIR/slurm.log"
sig=${1#--signal=}
kill -s "$sig" "$(cat "$FAKE_DIR/trainer.pid")"
"""
TORCHRUN_HELP_NEW = ("usage: torchrun [--nproc-per-node NPROC] [--max-restarts N] [--signals-to-handle SIGNALS]\n"
                     "  [--shutdown-timeout SHUTDOWN_TIMEOUT] training_script ...")
TORCHRUN_HELP_2_4 = "usage: torchrun [--nproc-per-node NPROC] [--max-restarts N] training_script ..."
HELP_ALL = ("usage: pretrain_gpt.py [--exit-signal-handler] [--exit-signal EXIT_SIGNAL] [--stall-timeout-s S]\n"
            "  --validate-only   check the flags and files, then exit")


def _write(path, body: str) -> str:
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def fake(tmp_path):
    d = tmp_path / "fake"
    (d / "bin").mkdir(parents=True)
    for name, body in (("srun", _SRUN), ("scontrol", _SCONTROL), ("scancel", _SCANCEL)):
        _write(d / "bin" / name, body)
    py = _write(d / "python", _FAKE_PY)
    save = tmp_path / "ckpt"
    save.mkdir()
    env = clean_env(PATH=f"{d / 'bin'}:{os.environ['PATH']}", FAKE_DIR=str(d), FAKE_SAVE=str(save), PYTHON=py,
                    FAKE_HELP=HELP_ALL, FAKE_TORCHRUN_HELP=TORCHRUN_HELP_NEW, SLURM_JOB_ID="4242",
                    SLURM_JOB_NODELIST="node[01-02]", SLURM_NNODES="2",
                    SLURM_SUBMIT_DIR=REPO, NPROC_PER_NODE="8", SAVE=str(save), TRAIN_ITERS="1000",
                    SIGNALS_REACH_ALL="0")  # the stand-in scancel signals the trainer alone, not every process
                    # (the real SLURM case, torchrun kept out of the signals: tests/test_slurm_jobs.py)
    return d, env, save


def _calls(d) -> list[list[str]]:
    text = (d / "calls").read_text() if (d / "calls").exists() else ""
    return [line.split("\0")[:-1] for line in text.split("\n") if line]


def _torchrun(d) -> list[str]:
    return next(c for c in _calls(d) if c[:2] == ["-m", "torch.distributed.run"])


def _run(cmd, env, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


# ------------------------------------------------------------------ run_local.sh
def test_run_local_validates_once_then_torchrun_with_restarts(fake):
    d, env, _ = fake
    env.update(NGPU="0", NPROC="4", MAX_RESTARTS="5")
    res = _run(["bash", "scripts/run_local.sh", "pretrain_gpt.py", "--lr", "1e-3"], env)
    assert res.returncode == 0, res.stderr
    calls = _calls(d)
    validate = [c for c in calls if "--validate-only" in c]
    assert validate == [["pretrain_gpt.py", "--device", "cpu", "--lr", "1e-3", "--validate-only"]]
    envs = (d / "envs").read_text().splitlines()
    assert envs[calls.index(validate[0])].split() == ["LOCAL_RANK=0", "RANK=0", "WORLD_SIZE=4"]
    tr = _torchrun(d)
    assert tr[tr.index("--max-restarts") + 1] == "5" and tr[tr.index("--nproc-per-node") + 1] == "4"
    assert "SIGUSR1" in tr[tr.index("--signals-to-handle") + 1].split(",")
    assert tr[-4:] == ["pretrain_gpt.py", "--device", "cpu", "--lr", "1e-3"][-4:]
    assert calls.index(validate[0]) < calls.index(tr)


def test_run_local_bad_flag_is_one_line_and_starts_nothing(fake):
    d, env, _ = fake
    env.update(NGPU="0", FAKE_INVALID="--lr must be >= 0, got -1.0")
    res = _run(["bash", "scripts/run_local.sh", "pretrain_gpt.py", "--lr", "-1"], env)
    assert res.returncode == 2
    assert res.stderr.strip() == "error: --lr must be >= 0, got -1.0"
    assert not any(c[:1] == ["-m"] for c in _calls(d))


def test_run_local_default_restarts_and_no_validation_when_switched_off(fake):
    d, env, _ = fake
    env.update(NGPU="0", VALIDATE="0")
    res = _run(["bash", "scripts/run_local.sh", "pretrain_gpt.py"], env)
    assert res.returncode == 0, res.stderr
    assert not any("--validate-only" in c for c in _calls(d))
    tr = _torchrun(d)
    assert tr[tr.index("--max-restarts") + 1] == "3"


def test_slow_validation_is_left_to_the_trainers(fake):
    d, env, _ = fake
    env.update(NGPU="0", FAKE_VALIDATE_SLEEP="30", VALIDATE_TIMEOUT="1")
    t0 = time.time()
    res = _run(["bash", "scripts/run_local.sh", "pretrain_gpt.py"], env)
    assert res.returncode == 0 and time.time() - t0 < 15, res.stderr
    assert "run_local: --validate-only still busy after 1 s (data indices): the trainers check the rest" in res.stderr
    assert _torchrun(d)


# ------------------------------------------------------------------ sbatch + slurm_launch.sh
def _directives(name: str) -> dict[str, str]:
    out = {}
    for line in open(os.path.join(REPO, "scripts", name), encoding="utf-8"):
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


@pytest.mark.parametrize("name", SBATCH)
def test_sbatch_asks_for_a_warning_signal_and_requeue(name):
    opts = _directives(name)
    m = re.fullmatch(r"B:USR1@(\d+)", opts["signal"])
    assert m, opts
    launch = open(os.path.join(REPO, "scripts", "slurm_launch.sh"), encoding="utf-8").read()
    shutdown = int(re.search(r"SHUTDOWN_TIMEOUT=\$\{SHUTDOWN_TIMEOUT:-(\d+)\}", launch).group(1))
    assert shutdown < int(m.group(1))  # torchrun waits for the save less than SLURM's warning lead
    assert "requeue" in opts and opts["open-mode"] == "append"


@pytest.mark.parametrize("name", SBATCH)
def test_sbatch_command_line(fake, name):
    d, env, save = fake
    res = _run(["bash", os.path.join("scripts", name)], env)
    assert res.returncode == 0, res.stderr
    tr = _torchrun(d)
    assert tr[tr.index("--rdzv-backend") + 1] == "c10d" and tr[tr.index("--rdzv-endpoint") + 1] == "node01:24242"
    assert tr[tr.index("--rdzv-id") + 1] == "4242" and tr[tr.index("--max-restarts") + 1] == "3"
    assert tr[tr.index("--nnodes") + 1] == "2" and tr[tr.index("--nproc-per-node") + 1] == "8"
    flags = tr[tr.index(f"pretrain_{name.split('_')[1]}.py") + 1:]
    assert flags[flags.index("--save") + 1] == flags[flags.index("--load") + 1] == str(save)
    assert "--exit-signal-handler" in flags and flags[flags.index("--exit-signal") + 1] == "SIGUSR1"
    validate = [c for c in _calls(d) if "--validate-only" in c]
    assert len(validate) == 1 and validate[0][:-1] == tr[tr.index(f"pretrain_{name.split('_')[1]}.py"):]
    envs = (d / "envs").read_text().splitlines()
    assert envs[_calls(d).index(validate[0])].split() == ["LOCAL_RANK=0", "RANK=0", "WORLD_SIZE=16"]
    assert "scontrol requeue" not in (d / "slurm.log").read_text()  # rc 0 but no checkpoint advanced


def test_bad_flag_stops_the_job_before_srun(fake):
    d, env, _ = fake
    env.update(FAKE_INVALID="--pipeline-model-parallel-size 8 does not divide 12 layers")
    res = _run(["bash", "scripts/slurm_gpt_2bw.sbatch"], env)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == "error: --pipeline-model-parallel-size 8 does not divide 12 layers"
    assert "error:" not in "\n".join(res.stderr.strip().splitlines()[:-1])
    assert not (d / "srun.argv").exists()


def _signalled_job(fake, saved_iter: int, **extra) -> tuple[subprocess.CompletedProcess, str]:
    d, env, save = fake
    env.update(FAKE_TRAIN="wait_signal", FAKE_SAVED_ITER=str(saved_iter), **extra)
    proc = subprocess.Popen(["bash", "scripts/slurm_gpt_2bw.sbatch"], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 30
    while not (d / "trainer.pid").exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # what sbatch --signal=B:USR1@300 does: the batch shell only
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), (d / "slurm.log").read_text()


def test_warning_signal_reaches_the_trainer_as_sigterm_under_an_older_torchrun(fake):
    """torch < 2.9: torchrun would die of SIGUSR1 (no --signals-to-handle); it forwards SIGTERM."""
    res, log = _signalled_job(fake, 700, FAKE_TORCHRUN_HELP=TORCHRUN_HELP_2_4)
    assert res.returncode == 0, res.stderr
    assert "scancel --signal=TERM 4242" in log and "trainer: got TERM" in res.stderr
    assert "slurm_launch: this torchrun does not forward SIGUSR1: sending the steps SIGTERM" in res.stderr
    assert "scontrol requeue 4242" in log


def test_signal_after_the_last_iteration_does_not_requeue(fake):
    res, log = _signalled_job(fake, 1000, FAKE_SIGNAL_RC="0")
    assert res.returncode == 0 and "trainer: got USR1" in res.stderr
    assert "requeue" not in log


def test_requeue_limit_and_no_progress(fake):
    res, log = _signalled_job(fake, 700, SLURM_RESTART_COUNT="20")
    assert "requeue" not in log and "requeued 20 times already" in res.stderr
    # torchrun exited 1 (it received the signal itself) but the trainers saved: a clean stop is exit 0
    assert res.returncode == 0 and "the trainers saved iteration 700 after SIGUSR1: a clean stop (exit 0)" in res.stderr


def test_signal_without_a_new_checkpoint_keeps_torchruns_status(fake):
    res, log = _signalled_job(fake, 0)
    assert "requeue" not in log and "no checkpoint after iteration 0 in this run: not requeueing" in res.stderr
    assert res.returncode == 1 and "clean stop" not in res.stderr


def test_crash_without_signal_is_not_requeued(fake):
    d, env, _ = fake
    env.update(FAKE_TRAIN="crash")
    res = _run(["bash", "scripts/slurm_gpt_2bw.sbatch"], env)
    assert res.returncode == 1 and "error: rank 1: training failed" in res.stderr
    assert "requeue" not in (d / "slurm.log").read_text()


# ------------------------------------------------------------------ torchrun of an older torch (review C1)
def test_run_local_with_an_older_torchrun_passes_only_the_flags_it_has(fake):
    d, env, _ = fake
    env.update(NGPU="0", VALIDATE="0", FAKE_TORCHRUN_HELP=TORCHRUN_HELP_2_4)
    res = _run(["bash", "scripts/run_local.sh", "pretrain_gpt.py", "--lr", "1e-3"], env)
    assert res.returncode == 0, res.stderr  # the stand-in refuses --signals-to-handle / --shutdown-timeout
    tr = _torchrun(d)
    assert "--signals-to-handle" not in tr and "--shutdown-timeout" not in tr
    assert tr[-4:] == ["--device", "cpu", "--lr", "1e-3"] and tr[tr.index("--max-restarts") + 1] == "3"
    assert "run_local: this torchrun has no --signals-to-handle (torch < 2.9)" in res.stderr
    assert "run_local: this torchrun has no --shutdown-timeout" in res.stderr
    env.update(FAKE_TORCHRUN_HELP=TORCHRUN_HELP_NEW, SHUTDOWN_TIMEOUT="77")
    (d / "calls").unlink()
    res = _run(["bash", "scripts/run_local.sh", "pretrain_gpt.py"], env)
    tr = _torchrun(d)
    assert res.returncode == 0 and "has no" not in res.stderr, res.stderr
    assert tr[tr.index("--shutdown-timeout") + 1] == "77" and "SIGUSR1" in tr[tr.index("--signals-to-handle") + 1]


def test_slurm_job_with_an_older_torchrun_passes_only_the_flags_it_has(fake):
    d, env, _ = fake
    env.update(FAKE_TORCHRUN_HELP=TORCHRUN_HELP_2_4.replace("[--max-restarts N]", "[--max-restarts N] "
                                                            "[--signals-to-handle SIGNALS]"))  # torch 2.9-2.12
    res = _run(["bash", "scripts/slurm_gpt_2bw.sbatch"], env)
    assert res.returncode == 0, res.stderr
    tr = _torchrun(d)
    assert "SIGUSR1" in tr[tr.index("--signals-to-handle") + 1].split(",") and "--shutdown-timeout" not in tr
    assert "slurm_launch: this torchrun has no --shutdown-timeout" in res.stderr
    # the flags come before the script
    assert tr[tr.index("pretrain_gpt.py") - 1] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


# ------------------------------------------------------------------ gloo's interface (review C6)
_GETENT = r"""#!/usr/bin/env bash
case "$2" in node01) echo "10.1.0.1 STREAM node01" ;; node02) echo "10.1.0.2 STREAM node02" ;; *) exit 2 ;; esac
"""
# this host is node01: its own address routes locally, node02 over ib0
_IP = r"""#!/usr/bin/env bash
case "$*" in
  "-o route get 10.1.0.1") echo "local 10.1.0.1 dev lo table local src 10.1.0.1 uid 0 \    cache <local> " ;;
  "-o route get 10.1.0.2") echo "10.1.0.2 dev ib0 src 10.1.0.1 uid 0 \    cache " ;;
  *) exit 1 ;;
esac
"""


@pytest.mark.parametrize("case", ["derived", "given", "one-node", "no-route"])
def test_slurm_job_sets_gloos_interface(fake, case):
    d, env, _ = fake
    if case != "no-route":
        _write(d / "bin" / "getent", _GETENT)
        _write(d / "bin" / "ip", _IP)
    if case == "given":
        env["GLOO_SOCKET_IFNAME"] = "eth3"
    if case == "one-node":
        env.update(SLURM_NNODES="1", SLURM_JOB_NODELIST="node01")
    res = _run(["bash", "scripts/slurm_gpt_2bw.sbatch"], env)
    assert res.returncode == 0, res.stderr
    expected = {"derived": "ib0", "given": "eth3", "one-node": "lo", "no-route": "unset"}[case]
    assert (d / "gloo").read_text().strip() == expected  # what torchrun (and so the trainers) inherit
    assert ("slurm_launch: gloo interface " + (expected if expected != "unset" else "(gloo's default")) in res.stderr


# ------------------------------------------------------------------ srun's CPUs (review P2)
@pytest.mark.parametrize("cpus", [{"SLURM_CPUS_ON_NODE": "96"}, {"SLURM_JOB_CPUS_PER_NODE": "128(x2),96",
                                                                 "SLURM_CPUS_ON_NODE": "128"}, {}])
def test_srun_gives_the_task_the_nodes_cpus(fake, cpus):
    d, env, _ = fake
    env.update(cpus)
    res = _run(["bash", "scripts/slurm_gpt_2bw.sbatch"], env)
    assert res.returncode == 0, res.stderr
    srun = (d / "srun.argv").read_text().split("\0")[:-1]
    opts = srun[:srun.index("bash")]
    assert [o for o in opts if o.startswith("--cpus-per-task")] == (["--cpus-per-task=96"] if cpus else [])
