"""The throughput benchmark's records turned into results: per (system, split, m), the medians over
rounds of throughput and of the ratios taken inside one round, beside the ideal values."""

from __future__ import annotations

import common
from throughput_systems import COUNTERPART, OURS, TORCH, ideal_bubble, ideal_vs_single, splits_of

from megatron_2bw.schedule.schedules import spec_of


def ceiling_vs_2bw(mine: list | None, theirs: list | None, ib: float | None) -> float | None:
    """The ratio to 2BW a schedule would reach if it idled only for its ideal bubble ``ib``: 2BW's
    (bubble-free) busiest rank's compute per microbatch (``theirs``, per rank) over this schedule's busiest
    rank's (``mine``), both measured in one round, times ``1 - ib``. None where a compute or the ideal is
    missing."""
    if not mine or not theirs or ib is None or None in mine or None in theirs or max(mine) <= 0:
        return None
    return max(theirs) / max(mine) * (1.0 - ib)


def _sps(r: dict | None, b: int) -> float | None:
    return r["steady_steps"] * r["m"] * b / r["steady_s"] if r else None


def _ratio(x, y):
    return x / y if x and y else None


def _quiet_groups(conf: dict, recs: list[dict]) -> dict[tuple[int, int], bool]:
    """(round, m) -> whether the other jobs' load stayed under ``quiet_cpus`` in every segment of it."""
    out = {}
    for m in conf["ms"]:
        for rnd in range(conf["rounds"]):
            loads = [r.get("foreign_cpus") for r in recs if r["round"] == rnd and r["m"] == m]
            out[rnd, m] = bool(loads) and all(x is not None and x < conf["quiet_cpus"] for x in loads)
    return out


def _per_round(by: dict, conf: dict, quiet: dict, s: str, sp: str, m: int) -> list[dict]:
    """System ``s`` (split ``sp``) at ``m`` in each round, with its ratios to the systems of the same round."""
    b, per_round = conf["micro_batch"], []
    for rnd in range(conf["rounds"]):
        r = by.get((rnd, s, sp, m))
        if r is None:
            continue
        one, t1 = by.get((rnd, "single", "uniform", m)), by.get((rnd, "torch_1f1b", "uniform", m))
        twin = by.get((rnd, COUNTERPART.get(s), "uniform", m))  # torch's counterpart, same round
        two = by.get((rnd, "2bw", sp, m)) if s != "2bw" else None  # PipeDream-2BW, same round and split
        wall = r["steps"] * m * b / r["wall_s"]
        wall_single = one and one["steps"] * m * b / one["wall_s"]
        sps = _sps(r, b)
        per_round.append(dict(sps=sps, vs_single=_ratio(sps, _sps(one, b)), vs_t1=_ratio(sps, _sps(t1, b)),
                              vs_twin=_ratio(sps, _sps(twin, b)), vs_2bw=_ratio(sps, _sps(two, b)),
                              wall=wall, wall_vs_single=_ratio(wall, wall_single),
                              foreign=r.get("foreign_cpus"), quiet=quiet[rnd, m],
                              bubble=r.get("bubble"), idle=r.get("idle_wait"),
                              compute=r.get("compute_ms_per_microbatch"),
                              two=two.get("compute_ms_per_microbatch") if two else None))
    return per_round


def _row(d: int, conf: dict, splits: dict, ceiling: dict, s: str, sp: str, m: int, per_round: list[dict]) -> dict:
    """One result: the medians over rounds beside the ideal values (the split's, the bubble's, 2BW's)."""
    ideal = ideal_vs_single(s, d, m)
    ib = ideal_bubble(s, d, m)
    ceilings = [ceiling_vs_2bw(p["compute"], p.pop("two"), ib) for p in per_round]
    chunks = TORCH[s][2] if s in TORCH else spec_of(s).chunks if s in OURS else 1
    vs = [p["vs_single"] for p in per_round if p["vs_single"] is not None]
    alone = s in ("single", "engine_d1")
    row = {
        "system": s, "d": 1 if alone else d, "m": m, "model": conf["model_name"], "split": sp,
        # per (virtual) stage: a rank of a two-chunk schedule holds two of them
        "layers_per_stage": [conf["model"]["num_layers"]] if alone else splits[sp] if chunks == 1
        else [conf["model"]["num_layers"] // (d * chunks)] * (d * chunks),
        "ideal_speedup": 1.0 if alone else ceiling.get(sp),
        # the schedule's bubble-limited ideal scaled by the split's imbalance (2BW: the ceiling itself)
        "ideal_vs_single_with_split": ideal if alone or sp not in ceiling else ideal * ceiling[sp] / d,
        "samples_per_sec": common.median(p["sps"] for p in per_round),
        "speedup_vs_single": common.median(vs),
        "ratio_vs_torch_1f1b": common.median(p["vs_t1"] for p in per_round),
        "ideal_vs_single": ideal,
        "ideal_vs_single_on_cores": min(ideal, conf["cpus"]),  # d processes share the machine's cores
        "ideal_vs_torch_1f1b": ideal / ideal_vs_single("torch_1f1b", d, m),
    }
    row.update({
        "chunks_per_rank": chunks,
        "torch_counterpart": COUNTERPART.get(s) if COUNTERPART.get(s) in conf["systems"] else None,
        "ratio_vs_torch_counterpart": common.median(p["vs_twin"] for p in per_round),
        "ratio_vs_torch_counterpart_per_round": [p["vs_twin"] for p in per_round],
        # against our 2BW of the same round and split: what a synchronous schedule gives up to it
        "ratio_vs_2bw": common.median(p["vs_2bw"] for p in per_round),
        "ratio_vs_2bw_per_round": [p["vs_2bw"] for p in per_round],
        # what the ratio to 2BW would be with no idle beyond the schedule's ideal bubble, from the
        # compute the busiest rank of each measured in the same round: the gap between the two is
        # the executor's; the gap from this to 1 is the ideal bubble's and the compute path's
        "ceiling_vs_2bw": common.median(ceilings),
        "ceiling_vs_2bw_per_round": ceilings,
    })
    row.update(_stages_and_spread(d, s, ib, per_round))
    if s == "engine_d1":
        row["overhead_vs_single_pct"] = _overhead(row["speedup_vs_single"])
        row["quiet_overhead_vs_single_pct"] = _overhead(row["quiet_speedup_vs_single"])
    return row


def _per_stage(per_round: list[dict], key: str, d: int) -> list | None:
    """Each stage's median over the rounds that measured ``key``."""
    rows = [p[key] for p in per_round if p[key] is not None]
    return [common.median(x[i] for x in rows) for i in range(d)] if rows else None


def _stages_and_spread(d: int, s: str, ib: float, per_round: list[dict]) -> dict:
    """The per-stage bubbles, waits and compute; the wall-clock ratios, the spread over rounds, the quiet ones."""
    bubble = _per_stage(per_round, "bubble", d)
    busy = [1.0 - x for x in bubble] if bubble and None not in bubble else None
    vs = [p["vs_single"] for p in per_round if p["vs_single"] is not None]
    quiet = [p for p in per_round if p["quiet"]]
    alone = s in ("single", "engine_d1")
    return {
        # the schedule's ideal idle fraction (balanced stages, free transfers) and each stage's measured
        # one over its steady window: 1 - compute / wall (the same clock for ours and torch's)
        "ideal_bubble": None if alone else ib,
        "bubble_per_stage": None if alone else bubble,
        # the ideal once the stages' measured compute is unequal: a stage with less compute than the
        # busiest idles the difference as well
        "ideal_bubble_with_balance_per_stage": ([1.0 - (1.0 - ib) * c / max(busy) for c in busy]
                                                if busy and max(busy) > 0 else None),
        # ours: the executor's idle clock (receive waits + update waits) / wall, what the trainer logs
        "idle_wait_per_stage": None if alone else _per_stage(per_round, "idle", d),
        # each rank's compute per microbatch in the window (all its chunks): a slower compute path
        # shows here, a schedule or transfer stall in the bubble
        "compute_ms_per_microbatch_per_stage": None if alone else _per_stage(per_round, "compute", d),
        "wall_samples_per_sec": common.median(p["wall"] for p in per_round),
        "wall_speedup_vs_single": common.median(p["wall_vs_single"] for p in per_round),
        "speedup_vs_single_min": min(vs) if vs else None,
        "speedup_vs_single_max": max(vs) if vs else None,
        "speedup_vs_single_per_round": [p["vs_single"] for p in per_round],
        "ratio_vs_torch_1f1b_per_round": [p["vs_t1"] for p in per_round],
        "rounds": len(per_round),
        "foreign_load_cpus": common.median(p["foreign"] for p in per_round),
        "quiet_rounds": len(quiet),
        "quiet_speedup_vs_single": common.median(p["vs_single"] for p in quiet),
        "quiet_ratio_vs_torch_1f1b": common.median(p["vs_t1"] for p in quiet),
        "compared_in_world_d": d,
    }


def summarize(d: int, conf: dict, out: dict) -> tuple[list[dict], dict]:
    """Per (system, m): medians over rounds of throughput and of the ratios taken inside each round.

    A (round, m) group is *quiet* when the other jobs' load stayed under ``quiet_cpus`` during
    every segment of it; the ``quiet_*`` fields repeat the medians over quiet groups only.
    """
    recs = out["records"]
    by = {(r["round"], r["system"], r["split"], r["m"]): r for r in recs}
    splits = out["splits"]
    bal = out["balance_ms"]  # per round: {split: [ms of each stage]}
    stage_ms = {sp: [common.median(r[sp][i] for r in bal) for i in range(d)] for sp in splits} if bal else {}
    ceiling = {sp: sum(ms) / max(ms) for sp, ms in stage_ms.items()}
    quiet_groups = _quiet_groups(conf, recs)
    results = []
    for m in conf["ms"]:
        for s, sp in [(x, sp) for x in conf["systems"] for sp in splits_of(x, splits)]:
            per_round = _per_round(by, conf, quiet_groups, s, sp, m)
            if per_round:
                results.append(_row(d, conf, splits, ceiling, s, sp, m, per_round))
    rounds_load = []
    for rnd in range(conf["rounds"]):
        xs = [r["foreign_cpus"] for r in recs if r["round"] == rnd and r.get("foreign_cpus") is not None]
        rounds_load.append(sum(xs) / len(xs) if xs else None)
    extra = {
        "stage_compute_ms_per_microbatch": stage_ms.get("uniform", []),
        "balance_ceiling_vs_single": ceiling.get("uniform"),
        "splits": splits,
        "stage_compute_ms_per_microbatch_by_split": stage_ms,
        "ideal_speedup_by_split": ceiling,
        "foreign_load_cpus_per_round": rounds_load,
        "skipped": out.get("skipped", {}),
        "quiet_wait_s_per_segment": out.get("quiet_wait_s"),
        "records": recs,
    }
    return results, extra




def _overhead(speedup: float | None) -> float | None:
    """Step-time overhead in % of a system whose throughput is ``speedup`` x the plain loop's."""
    return 100.0 * (1.0 / speedup - 1.0) if speedup else None
