"""The engine benchmark's summary (benchmarks/engine.py): per length, the ratios of median times
(speedups over the full path, shares of the limit, ratios to a prefill) and the printed table.
benchmarks/engine.py's docstring names every key."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.engine_paths import TIERS, Timed
from kvnotes.engine.limit import fastest


def summarize(length: int, paths: list[Timed], info: dict[str, Any]) -> dict[str, Any]:
    med = {p.name: statistics.median(p.times) for p in paths if p.times}

    def ratio(a: str, b: str) -> float | None:
        return med[a] / med[b] if a in med and b in med else None

    def speed(tag: str, path: str) -> float | None:
        return ratio(f"{tag}_full", f"{tag}_{path}")

    row: dict[str, Any] = {"length": length, "prefill_s": med.get("prefill")}
    row["extend1_ratio"] = ratio("extend1", "prefill")
    row["extend1_bare_ratio"] = ratio("extend1_bare", "prefill")
    row["extend1_inplace_ratio"] = ratio("extend1_inplace", "prefill")
    row["extend1_gemm_floor"] = ratio("extend1_gemms", "prefill")
    row["extend1_over_gemm_floor"] = ratio("extend1", "extend1_gemms")
    row["extend1_copy_ratio"] = ratio("extend1_copy", "prefill")
    row["full_downstream_ratio"] = ratio("full_downstream", "prefill")
    row["erratum_ratio"] = ratio("erratum", "prefill")
    row["erratum_inplace_ratio"] = ratio("erratum_inplace", "prefill")
    if "erratum_graph" in med:  # CUDA: replayed from a graph (kvnotes.engine.graphs)
        row["extend1_graph_ratio"] = ratio("extend1_graph", "prefill")
        row["erratum_graph_ratio"] = ratio("erratum_graph", "prefill")
    row["erratum_floor"] = info.get("erratum_floor")
    row["erratum_gemm_floor"] = ratio("erratum_gemms", "prefill")
    gemm = row["erratum_gemm_floor"]
    row["erratum_over_gemm_floor"] = row["erratum_ratio"] / gemm if row["erratum_ratio"] and gemm else None
    for tag, key in (("one", "transplant"), ("multi", "multiblock")):
        tp = speed(tag, "transplant")
        bare, eng, inplace = speed(tag, "limit"), speed(tag, "limit_engine"), speed(tag, "limit_inplace")
        lim, lim_path = fastest(bare=bare, engine=eng, inplace=inplace)  # kvnotes.engine.limit
        row[f"{key}_speedup"] = tp
        lkey = "limit" if tag == "one" else "multiblock_limit"
        row[f"{lkey}_speedup"], row[f"{lkey}_path"] = lim, lim_path
        row[f"{lkey}_bare_speedup"] = bare
        row[f"{key}_share_of_limit"] = tp / lim if tp is not None and lim is not None else None
        row[f"{key}_cold_speedup"] = speed(tag, "transplant_cold")
        for variant in ("unverified", "resident"):  # verify=False: no hash; resident: no load
            sp = speed(tag, f"transplant_{variant}")
            row[f"{key}_{variant}_share_of_limit"] = sp / lim if sp and lim else None
        row[f"{key}_limit_engine_speedup"] = eng
        row[f"{key}_limit_inplace_speedup"] = inplace
        for name in sorted(n for n in med if n.startswith(f"{tag}_transplant_k")):
            k = name.removeprefix(f"{tag}_transplant_")
            sp = speed(tag, f"transplant_{k}")
            row[f"{key}_{k}_speedup"] = sp
            row[f"{key}_{k}_share_of_limit"] = sp / lim if sp is not None and lim is not None else None
    one_lim, multi_lim = row.get("limit_speedup"), row.get("multiblock_limit_speedup")
    for key, tag, path, lim in (("inplace", "one", "inplace", one_lim),
                                ("multiblock_inplace", "multi", "inplace", multi_lim),
                                ("multiblock_k0", "multi", "inplace_k0", multi_lim)):
        sp = speed(tag, path)
        if sp is None:
            continue
        if key == "multiblock_k0":  # the name is the in-place path's; today's transplant keeps it under
            row["multiblock_k0_transplant_share_of_limit"] = row.get("multiblock_k0_share_of_limit")
        row[f"{key}_speedup"], row[f"{key}_share_of_limit"] = sp, sp / lim if lim else None
    for tier in TIERS:  # the one-block transplant in place, from each tier
        sp = speed("one", "inplace" if tier == "device" else f"tier_{tier}")
        if sp is not None:
            row[f"tier_{tier}_speedup"] = sp
            row[f"tier_{tier}_share_of_limit"] = sp / one_lim if one_lim else None
    if "map" in med:
        row["map_ratio"] = ratio("map", "prefill")
    if "attribution" in med:  # attribution vs exact patching, each as a ratio to one prefill
        row["attribution_ratio"], row["map_over_attribution"] = ratio("attribution", "prefill"), ratio("map", "attribution")
    row.update(info)
    row["seconds"] = med
    peaks = {p.name: p.peak_bytes / 2**30 for p in paths if p.peak_bytes}
    if peaks:  # CUDA: each call's own working set, and the weights plus the largest of them
        row["rise_gib"] = peaks
        row["peak_gib"] = info["weights_gib"] + max(peaks.values())
    return row


def table(rows: list[dict[str, Any]]) -> str:
    cols = [("length", "L", "{:.0f}"), ("prefill_s", "prefill s", "{:.3f}"),
            ("extend1_ratio", "extend1", "{:.4f}"), ("extend1_inplace_ratio", "ext1 inpl", "{:.4f}"),
            ("extend1_bare_ratio", "ext1 bare", "{:.4f}"),
            ("extend1_gemm_floor", "ext1 gemm", "{:.4f}"), ("extend1_copy_ratio", "ext1 copy", "{:.4f}"), ("full_downstream_ratio", "full_down", "{:.3f}"),
            ("erratum_ratio", "erratum", "{:.4f}"), ("erratum_inplace_ratio", "err inpl", "{:.4f}"),
            ("erratum_floor", "floor", "{:.4f}"),
            ("erratum_flop_floor", "flop floor", "{:.4f}"), ("erratum_gemm_floor", "gemm floor", "{:.4f}"),
            ("transplant_speedup", "tp x", "{:.2f}"), ("limit_speedup", "limit x", "{:.2f}"), ("limit_path", "limit via", "{}"),
            ("transplant_share_of_limit", "tp/limit", "{:.2f}"),
            ("transplant_resident_share_of_limit", "resid/lim", "{:.2f}"), ("multiblock_speedup", "multi x", "{:.2f}"),
            ("multiblock_share_of_limit", "multi/limit", "{:.2f}"), ("multi_flop_ceiling", "ceiling", "{:.2f}"),
            ("inplace_share_of_limit", "inpl/lim", "{:.2f}"), ("multiblock_inplace_share_of_limit", "m inpl/lim", "{:.2f}"),
            ("multiblock_k0_transplant_share_of_limit", "k0 tp/lim", "{:.2f}"),
            ("multiblock_k0_share_of_limit", "k0/limit", "{:.2f}"),
            ("tier_device_speedup", "dev x", "{:.1f}"), ("tier_host_speedup", "host x", "{:.1f}"),
            ("tier_disk_speedup", "disk x", "{:.1f}"), ("tier_disk_warm_speedup", "warm x", "{:.1f}"), ("multiblock_k1_share_of_limit", "k1/limit", "{:.2f}"),
            ("kvboost_none_speedup", "kvb none x", "{:.2f}"), ("kvboost_selective_speedup", "kvb sel x", "{:.2f}"),
            ("kvboost_cacheblend_speedup", "kvb cb x", "{:.2f}"), ("kvboost_doc_none_speedup", "kvb doc none", "{:.2f}"),
            ("kvboost_doc_cacheblend_speedup", "kvb doc cb", "{:.2f}"), ("kvboost_blk_none_speedup", "kvb blk none", "{:.2f}"),
            ("kvboost_blk_selective_speedup", "kvb blk sel", "{:.2f}"), ("map_ratio", "map", "{:.2f}"),
            ("attribution_ratio", "attrib", "{:.3f}"), ("estimate_gib", "est GiB", "{:.1f}"), ("peak_gib", "peak GiB", "{:.1f}")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    lines = [" ".join(f"{h:>11}" for _, h, _ in cols)]
    for r in rows:
        cells = [fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in cols]
        lines.append(" ".join(f"{c:>11}" for c in cells))
    return "\n".join(lines)
