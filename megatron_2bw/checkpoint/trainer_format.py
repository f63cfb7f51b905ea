"""The trainer's checkpoint file (format 3): Megatron-LM v2.x contents plus the engine state by parameter name.

One file per (tensor, pipeline) rank holds what Megatron's loaders and transformers' converters
read (``model`` nested as ``language_model.{embedding,encoder}``, always the newest weights W(step);
``args`` as an ``argparse.Namespace``; ``checkpoint_version`` 3.0; ``iteration``) and, under keys
of our own, what a bitwise resume needs: ``stage`` (step, schedule, 2BW's older version, fp32
master copy, optimizer state, loss scaler), ``rng``, ``data``, ``layout``, ``config``.

Every per-parameter tensor of ``stage`` is a dict keyed by global parameter name (the name in the
full single-stage model), not the engine's flat buffer: a checkpoint is then resharded to another
tensor x pipeline layout exactly like the weights (``checkpoint.reshard``), and a stage whose
parameter order differs still loads it. An MoE model's expert stacks ``[E, out, in]`` are saved whole, every
expert (the global expert axis: at expert-parallel size e > 1 data rank 0 gathers the other pieces first,
``expert_gather``), and a rank takes its own experts of each at load, so any expert-parallel size resumes from
the file.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from ..config import ModelConfig
from ..errors import ConfigError
from . import manifest
from .megatron_format import Exported, megatron_args, rank_contents, rank_weights, read_rank_files
from .names import Split, is_expert_stack

FORMAT = 3
Views = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def is_flat(value, numel: int) -> bool:
    """Whether ``value`` is a per-parameter flat buffer of a stage with ``numel`` parameters."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def named_engine_state(esd: dict, views: Views, numel: int, newest_slot: int) -> tuple[dict, dict]:
    """(``stage`` entry by global name, newest weights by global name) from the engine's flat state dict."""
    versions = esd["versions"]
    older = [views(v) for i, v in enumerate(versions) if i != newest_slot]
    stage = {
        "step": int(esd["step"]), "schedule": esd["schedule"], "older": older[0] if older else None,
        "master": views(esd["master"]) if esd.get("master") is not None else None,
        "optimizer": {k: views(v) if is_flat(v, numel) else v for k, v in esd["optimizer"].items()},
        "scaler": esd["scaler"],
    }
    return stage, views(versions[newest_slot])


def train_args(model: ModelConfig, cli_args: dict, *, iteration: int, t: int, d: int, schedule: str,
               dtype: str, split: Split = None, chunks: int = 1) -> argparse.Namespace:
    """Megatron's ``args``: its model and parallel fields, then every flag of this run (same names as Megatron's)."""
    tok = {k: cli_args.get(k) for k in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")}
    meta = Exported(model, {}, iteration, {k: v for k, v in tok.items() if v}, dtype)
    ns = vars(megatron_args(meta, t, d, schedule, split, chunks))
    ns.update({k: v for k, v in cli_args.items() if k not in ns or v is not None})
    ns.update(tensor_model_parallel_size=t, pipeline_model_parallel_size=d, pipeline_schedule=schedule,
              virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None)
    return argparse.Namespace(**ns)


def file_contents(model: ModelConfig, newest: dict[str, torch.Tensor], *, args: argparse.Namespace, iteration: int,
                  t: int, pp: int, d: int, split: Split = None, chunks: int = 1, **ours) -> dict:
    """One rank's file: Megatron's keys from ``newest`` (global names) and ``args``, then ``ours`` as given
    (``chunks`` > 1: ``model0``, ``model1``, ... one per model chunk, as Megatron's interleaved runs save)."""
    meta = Exported(model, {}, iteration)
    contents = rank_contents(meta, newest, t=t, d=d, pp=pp, split=split, chunks=chunks)
    contents["args"] = args
    contents["format"] = FORMAT
    contents.update(ours)
    return contents


def newest_weights(sd: dict, model: ModelConfig) -> dict[str, torch.Tensor]:
    """A format-3 file's newest weights by global name (views of what was loaded)."""
    lay = sd["layout"]
    return rank_weights(sd, model, t=lay["t"], d=lay["d"], pp=lay["pp_rank"], split=lay.get("split"))


def flatten(named: dict[str, torch.Tensor], order: list[str], sizes: list[int], what: str, path: str,
            offsets: list[int] | None = None) -> torch.Tensor:
    """One flat buffer in ``order`` from a per-name dict (a one-line error naming the file when it does not fit);
    ``offsets`` (each parameter's, then the buffer's length): where a stage cut into segments has padding
    between them, the parameters go there and the padding is zeros."""
    missing = [n for n in order if n not in named]
    if missing:
        raise ConfigError(f"checkpoint file {path} lacks {what} of parameter {missing[0]} (another model or layout?)")
    for n, size in zip(order, sizes):
        if named[n].numel() != size:
            raise ConfigError(f"checkpoint file {path} has {named[n].numel()} values of {what} {n} but this stage "
                              f"has {size} (another model or layout?)")
    parts = [named[n] for n in order]
    if offsets is not None and any(o + n != nxt for o, n, nxt in zip(offsets, sizes, offsets[1:])):
        out = parts[0].new_zeros(offsets[-1])
        for o, n, t in zip(offsets, sizes, parts):
            out[o:o + n].copy_(t.reshape(-1))
        return out
    view = _flat_view(parts)
    return view if view is not None else torch.cat([t.reshape(-1) for t in parts])


def _flat_view(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """``parts`` as one flat view when they lie back to back in one storage, as a file saved from the engine's
    flat buffers holds them: no copy (a memory-mapped file's pages are then read once, by the restore's copy)."""
    if not parts:
        return None
    first = parts[0]
    ptr, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in parts:
        if (t.dtype != first.dtype or not t.is_contiguous() or t.untyped_storage().data_ptr() != ptr
                or t.storage_offset() != offset):
            return None
        offset += t.numel()
    return torch.as_strided(first, (offset - first.storage_offset(),), (1,), first.storage_offset())


def own_experts(named: dict[str, torch.Tensor], experts: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """``named`` with each expert stack (saved whole: the global expert axis) cut to expert-parallel rank ``r`` of
    ``e``'s experts (``experts`` = (r, e); None: all of them)."""
    if experts is None or experts[1] == 1:
        return named
    r, e = experts
    return {n: v.chunk(e, 0)[r] if is_expert_stack(n) else v for n, v in named.items()}


def engine_state(sd: dict, model: ModelConfig, order: list[str], sizes: list[int], local_names: list[str],
                 num_versions: int, offsets: list[int] | None = None, experts: tuple[int, int] | None = None) -> dict:
    """The engine's flat state dict (``PipelineRank.load_state_dict``) from a format-3 file (``offsets``: as
    :func:`flatten`'s, for a stage cut into segments; ``experts``: this rank's (expert-parallel rank, size), whose
    experts it takes of every expert stack).

    A file without 2BW's older version (a flush schedule's, or converted) starts both versions equal.
    """
    path, st = sd.get("path", "?"), sd["stage"]

    def flat(named: dict[str, torch.Tensor], what: str) -> torch.Tensor:
        return flatten(own_experts(named, experts), order, sizes, what, path, offsets)

    newest = flat(newest_weights(sd, model), "the weights")
    older = flat(st["older"], "the older weight version") if st.get("older") else newest
    step = int(st["step"])
    versions = [newest] if num_versions == 1 else [newest, older] if step % 2 == 0 else [older, newest]
    numel = sum(sizes) if offsets is None else offsets[-1]
    opt = {k: flat(v, f"optimizer state {k}") if isinstance(v, dict) else v for k, v in st["optimizer"].items()}
    master = flat(st["master"], "the fp32 master copy") if st.get("master") else None
    if master is not None and master.numel() != numel:
        raise ConfigError(f"checkpoint file {path} has a master copy of another size")
    return {"step": step, "schedule": st["schedule"], "names": local_names, "versions": versions,
            "master": master, "optimizer": opt, "scaler": st["scaler"]}


def verified_rank_files(iter_dir: str) -> dict[tuple[int, int], dict]:
    """``read_rank_files`` after checking every file against the iteration's manifest (as the trainer does):
    an exported or resharded model is never made of flipped bytes; a format-3 checkpoint without a manifest
    is refused (that format always writes one). A Megatron-LM checkpoint has none and is read as it is."""
    doc = manifest.verify(iter_dir, require=False)
    files = read_rank_files(iter_dir)
    if doc is None and any(isinstance(sd, dict) and sd.get("format") == FORMAT for sd in files.values()):
        raise ConfigError(f"checkpoint {iter_dir} has no {manifest.MANIFEST} but its files are format "
                          f"{FORMAT}, which always writes one: the save did not finish or the manifest "
                          "was removed, so its files cannot be verified")
    return files
