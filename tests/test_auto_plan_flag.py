"""``--auto-plan`` in the trainer: a single process profiles, plans and trains with the choice;
a multi-process job without a profile file is refused before any collective."""

from __future__ import annotations

import os

import e2e
import pytest
from e2e import PY, REPO, clean_env, read_metrics, run

from megatron_2bw.config.presets import get_preset
from megatron_2bw.planner.auto_plan import auto_plan

corpus = e2e.corpus  # the session fixture, bound here so that pytest finds it for this module's tests

COMMON = ["--model-preset", "gpt-tiny", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3",
          "--device", "cpu", "--log-interval", "1", "--eval-iters", "0"]


def test_single_process_profiles_plans_and_trains(corpus, tmp_path):
    profile, metrics = str(tmp_path / "profile.json"), str(tmp_path / "m.jsonl")
    res = run([PY, os.path.join(REPO, "pretrain_gpt.py"), "--auto-plan", "--auto-plan-profile", profile,
               "--metrics-file", metrics, *COMMON, *corpus.data_args()], env=clean_env(), timeout=180)
    assert res.returncode == 0, res.describe()
    assert os.path.isfile(profile)  # measured on this device and kept for the next run
    start = next(r for r in read_metrics(metrics) if r["type"] == "start")
    train = [r for r in read_metrics(metrics) if r["type"] == "train"]
    assert len(train) == 3
    # independent check: the planner on the written profile makes the same choice
    cfg = get_preset("gpt-tiny", vocab_size=512)
    choice = auto_plan(cfg, 1, 8, profile_path=profile, device="cpu")
    assert (start["layout"]["t"], start["layout"]["d"]) == (choice.t, choice.d) == (1, 1)
    assert start["micro_batch_size"] == choice.b and start["schedule"] == choice.schedule
    assert "--auto-plan chose" in res.output


def test_multi_process_job_needs_a_profile_file(corpus):
    env = clean_env(WORLD_SIZE="4", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    res = run([PY, os.path.join(REPO, "pretrain_gpt.py"), "--auto-plan", *COMMON, *corpus.data_args()],
              env=env, timeout=60)
    assert res.returncode == 2
    lines = [line for line in res.stderr.strip().splitlines() if line]
    assert lines == ["error: --auto-plan with 4 processes needs --auto-plan-profile FILE made beforehand "
                     "(a single-process --auto-plan run or tools/profile_model.py writes it): "
                     "ranks must not profile apart"]


def test_the_runs_attention_settings_reach_the_planner(monkeypatch):
    """The kernel the planner counts attention memory for is the run's: ``--attention-backend`` and
    ``--reset-attention-mask`` reach the cluster of its request, over the preset's (the search with them is
    the planner's tests')."""
    import megatron_2bw.planner.auto_plan as planner
    from megatron_2bw.cli import parse_args
    from megatron_2bw.training.auto_layout import plan_layout

    seen = {}

    class Stop(Exception):
        pass

    def request(model, cluster, *a, **k):  # the search's request: what it would plan for, then stop
        seen["cluster"] = cluster
        raise Stop

    monkeypatch.setattr(planner, "PlanRequest", request)
    monkeypatch.setattr(planner, "profile_or_load", lambda *a, **k: (None, False))
    tokens = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]
    for flags, want in [(["--attention-backend", "unfused", "--reset-attention-mask"], ("unfused", True)),
                        ([], ("auto", False))]:
        args = parse_args([*COMMON, "--auto-plan", "--cluster", "dgx-h100", *tokens, *flags], "gpt")
        with pytest.raises(Stop):
            plan_layout(args, "gpt", 1)
        assert (seen["cluster"].attention_backend, seen["cluster"].reset_attention_mask) == want
