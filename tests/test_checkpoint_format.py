"""The trainer's checkpoint contents (format 3): Megatron-LM v2.x keys with the newest weights, the engine
state by global name beside them; formats 1 and 2 still load; weights-only restores (--finetune,
--no-load-optim); transformers' converter reads a checkpoint as the trainer saved it."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import pytest
import torch
from ckpt_runs import _ckpt_data, one_rank_run  # noqa: F401
from export_helpers import hf_converter, max_err

from megatron_2bw.checkpoint import checkpointing as ck
from megatron_2bw.checkpoint import trainer_format
from megatron_2bw.checkpoint.names import WORD
from megatron_2bw.config import OptimizerConfig, PipelineConfig
from megatron_2bw.config.presets import get_preset
from megatron_2bw.errors import ConfigError
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec, run_layers
from megatron_2bw.parallel_state import ParallelState
from megatron_2bw.pipeline.build import build_stage
from megatron_2bw.pipeline.executor import PipelineRank
from megatron_2bw.pipeline.weights import GlobalNames
from megatron_2bw.tensor_parallel.random import RNGTracker

CPU = torch.device("cpu")


def _stage(schedule: str = "2bw", cfg=None, optimizer: str = "adam") -> tuple[PipelineRank, ModelSpec]:
    cfg = cfg or get_preset("gpt-tiny")
    tracker = RNGTracker(7, 0)
    spec = ModelSpec(cfg, ModelGroups(), 1234, rng=tracker)
    stage = build_stage(lambda: spec.build_stage(1, 0), spec.loss_fn(), ParallelState.single(),
                          PipelineConfig(schedule, 1, 2), OptimizerConfig(optimizer, lr=1e-2),
                          (1, cfg.seq_length, cfg.hidden_size), rng_tracker=tracker, names=GlobalNames(0, tied=WORD))
    return stage, spec


def _trained(steps: int = 3, schedule: str = "2bw") -> tuple[PipelineRank, ModelSpec, callable]:
    stage, spec = _stage(schedule)
    cfg = spec.cfg
    data = torch.randint(0, cfg.vocab_size, (64, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    batch = lambda mb: spec.make_batch(data[mb % 64:mb % 64 + 1])  # noqa: E731
    stage.train(steps, batch, lambda t: 1e-2)
    return stage, spec, batch


def _config(stage: PipelineRank, spec: ModelSpec) -> dict:
    return {"model": asdict(spec.cfg), "optimizer": asdict(stage.opt), "pipeline": {"layer_split": None}}


def _payload(stage, spec, iteration: int) -> dict:
    return ck.payload(stage, iteration=iteration, tracker=stage.rng, consumed_samples=4 * iteration, global_batch=4,
                      config=_config(stage, spec), args={"micro_batch_size": 1, "lr": 1e-2})


def _save(root: str, stage, spec, iteration: int) -> None:
    ck.save(root, iteration, ParallelState.single(), lambda: _payload(stage, spec, iteration))


def test_contents_are_megatrons_with_the_newest_weights():
    stage, spec, _ = _trained(3)
    sd = _payload(stage, spec, 3)
    assert isinstance(sd["args"], argparse.Namespace) and sd["checkpoint_version"] == 3.0 and sd["iteration"] == 3
    a = sd["args"]
    assert ((a.padded_vocab_size, a.num_layers, a.hidden_size, a.bias_gelu_fusion, a.openai_gelu)
            == (384, 4, 64, False, True))
    assert (a.micro_batch_size, a.tensor_model_parallel_size, a.pipeline_schedule) == (1, 1, "2bw")
    enc = sd["model"]["language_model"]["encoder"]
    assert sorted({k.split(".")[1] for k in enc if k.startswith("layers.")}) == ["0", "1", "2", "3"]
    newest = dict(stage.weights.layers(3).named_parameters())  # W(3): full-model names at t = d = 1
    older = dict(stage.weights.layers(2).named_parameters())
    got = trainer_format.newest_weights(sd, spec.cfg)
    assert set(got) == set(newest) == set(sd["stage"]["older"])
    assert all(torch.equal(got[n], newest[n]) for n in newest)
    assert all(torch.equal(sd["stage"]["older"][n], older[n]) for n in older)
    assert any(not torch.equal(older[n], newest[n]) for n in newest)
    assert torch.equal(enc["layers.2.self_attention.query_key_value.weight"], newest["3.attn.qkv.weight"])
    exp_avg = stage.updater.optimizer.state_dict()["exp_avg"]
    saved = sd["stage"]["optimizer"]["exp_avg"]
    assert torch.equal(torch.cat([saved[n].reshape(-1) for n in stage.weights.global_names]), exp_avg)


def _continue(stage, batch, steps: int = 2) -> list[float]:
    return [r.loss for r in stage.train(steps, batch, lambda t: 1e-2)]


def test_format_3_restores_bitwise_and_continues_identically(tmp_path):
    stage, spec, batch = _trained(3)
    _save(str(tmp_path), stage, spec, 3)
    fresh, _ = _stage()
    ck.restore(ck.load_rank_file(str(tmp_path), 3, 1, 1, 0, 0), fresh, fresh.rng, CPU)
    assert fresh.step == 3
    a, b = fresh.state_dict(), stage.state_dict()
    assert all(torch.equal(x, y) for x, y in zip(a["versions"], b["versions"]))
    assert all(torch.equal(a["optimizer"][k], b["optimizer"][k]) for k in ("exp_avg", "exp_avg_sq"))
    assert _continue(fresh, batch) == _continue(stage, batch)


@pytest.mark.parametrize("fmt", [1, 2])
def test_formats_1_and_2_still_load(tmp_path, fmt):
    """Older files: flat engine buffers under ``stage``, ``model`` flat (stage-local names in format 1)."""
    stage, spec, batch = _trained(3)
    esd = stage.state_dict()
    model = dict(zip(stage.weights.names if fmt == 1 else stage.weights.global_names,
                     stage.weights._views(esd["versions"][stage.weights.slot(3)])))
    old = {"format": fmt, "iteration": 3, "layout": {"t": 1, "d": 1, "w": 1, "tp_rank": 0, "pp_rank": 0,
                                                     "schedule": "2bw"},
           "model": model, "stage": esd, "rng": _payload(stage, spec, 3)["rng"], "config": _config(stage, spec),
           "data": {"consumed_train_samples": 12, "global_batch_size": 4}, "args": {}}
    ck.atomic_torch_save(old, ck.checkpoint_path(str(tmp_path), 3, 0, 0, 1))
    fresh, _ = _stage()
    ck.restore(ck.load_rank_file(str(tmp_path), 3, 1, 1, 0, 0), fresh, fresh.rng, CPU)
    assert _continue(fresh, batch) == _continue(stage, batch)
    ck.atomic_torch_save({**old, "format": 99}, ck.checkpoint_path(str(tmp_path), 3, 0, 0, 1))
    with pytest.raises(ConfigError, match=r"not a megatron_2bw checkpoint of format 1 or 2 or 3 \(format: 99\)"):
        ck.load_rank_file(str(tmp_path), 3, 1, 1, 0, 0)


@pytest.mark.parametrize("mode", ["finetune", "no_load_optim"])
def test_weights_only_restores(tmp_path, mode):
    stage, spec, batch = _trained(3)
    _save(str(tmp_path), stage, spec, 3)
    fresh, _ = _stage()
    sd = ck.load_rank_file(str(tmp_path), 3, 1, 1, 0, 0)
    ck.restore(sd, fresh, fresh.rng, CPU, finetune=mode == "finetune", load_optim=False)
    opt = fresh.updater.optimizer.state_dict()
    assert opt["steps"] == 0 and float(opt["exp_avg"].abs().sum()) == 0.0 == float(opt["exp_avg_sq"].abs().sum())
    newest = stage.weights.flat[stage.weights.slot(3)]
    if mode == "finetune":  # step 0, every version the checkpoint's newest weights
        assert fresh.step == 0 and all(torch.equal(f, newest) for f in fresh.weights.flat)
    else:  # the step and both 2BW versions as saved
        assert fresh.step == 3 and all(torch.equal(a, b) for a, b in zip(fresh.weights.flat, stage.weights.flat))


def test_transformers_converter_reads_the_trainers_checkpoint(one_rank_run):  # noqa: F811
    """transformers' convert_megatron_gpt2_checkpoint on the file as saved (t = 1, d = 1) gives our logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    conv = hf_converter("gpt2")
    sd = torch.load(ck.checkpoint_path(one_rank_run.save, 4, 0, 0, 1), map_location="cpu", weights_only=False)
    a = sd["args"]
    act = "gelu_fast" if a.bias_gelu_fusion else "gelu_new" if a.openai_gelu else "gelu"
    config = GPT2Config(activation_function=act, layer_norm_epsilon=a.layernorm_epsilon)
    out = conv.convert_megatron_checkpoint(None, sd, config)
    hf = GPT2LMHeadModel(config).eval()
    missing, unexpected = hf.load_state_dict(out, strict=False)
    assert missing == [] and all(k.endswith(("attn.bias", "attn.masked_bias")) for k in unexpected)
    # ours: the engine restored from the same file, its newest weights run layer by layer
    cfg = ck.model_config(sd["config"])
    stage, _ = _stage(sd["layout"]["schedule"], cfg)
    ck.restore(ck.load_rank_file(one_rank_run.save, 4, 1, 1, 0, 0), stage, stage.rng, CPU)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens).logits[..., :cfg.vocab_size]
        ours = run_layers(list(stage.newest_layers.eval()), {"tokens": tokens})[..., :cfg.vocab_size]
    assert config.vocab_size == cfg.padded_vocab_size(1) and theirs.shape == ours.shape
    assert max_err(theirs, ours) < 1e-5
    assert float(ours.std()) > 0.1  # trained weights, not a degenerate comparison


def _masks(tracker: RNGTracker) -> torch.Tensor:
    with tracker.fork():  # what attention dropout draws
        return torch.nn.functional.dropout(torch.ones(64), 0.5)


@pytest.mark.parametrize("tagged", [True, False], ids=["tagged", "untagged-older-checkpoint"])
def test_tracker_state_of_another_device_reseeds_deterministically(tagged, caplog):
    """Review C5: a GPU's tracker state (16 bytes: Philox seed and offset) restored into a CPU tracker
    (a 5056-byte Mersenne-Twister state) raised "RNG state is wrong size" at the first dropout."""
    import logging

    from megatron_2bw.tensor_parallel.recompute import RNGSnapshot

    saved = RNGSnapshot.capture(CPU, RNGTracker(7, 0)).as_dict()
    assert saved["tracker_device"] == "cpu" and saved["tracker"].numel() == 5056
    philox = torch.tensor([5, 0, 0, 0, 0, 0, 0, 0, 12, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)  # seed 5, offset 12
    foreign = {**saved, "tracker": philox, "tracker_device": "cuda" if tagged else None}
    runs = []
    for _ in range(2):
        tracker = RNGTracker(7, 0)
        with caplog.at_level(logging.WARNING, logger="megatron_2bw.tensor_parallel.random"):
            RNGSnapshot.from_dict(foreign).restore(CPU, tracker)
        runs.append(_masks(tracker))
    assert "re-seeded it deterministically" in caplog.text
    assert torch.equal(runs[0], runs[1])  # the same checkpoint resumes to the same masks
    assert not torch.equal(runs[0], _masks(RNGTracker(7, 0)))  # not a restart of the stream from scratch
    other = RNGTracker(7, 0)
    RNGSnapshot.from_dict({**foreign, "tracker": philox.flip(0)}).restore(CPU, other)
    assert not torch.equal(runs[0], _masks(other))  # another saved state, another stream
    # a state of this device is still restored as is (bitwise)
    src = RNGTracker(7, 0)
    _masks(src)
    snap = RNGSnapshot.capture(CPU, src).as_dict()
    dst = RNGTracker(7, 0)
    RNGSnapshot.from_dict(snap).restore(CPU, dst)
    assert torch.equal(_masks(dst), _masks(src))
