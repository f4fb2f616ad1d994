"""Probe `knockout`: does the decision token read the notes? Attention knockout and read heads.

On the new prompt, chosen keys are removed from attention (-inf before the softmax) and the signed
reversion r = (oracle - score) / (oracle - stale) is read: 1 = back at the stale score, > 1.5
overshoots past it, < 0 moves away from it. Two variants: `decision` masks only the decision
token's attention (on the cached K/V, so positions after the notes keep what they read there);
`after_notes` hides the keys from every later query, in every layer (nothing downstream can read
them). Key sets: the top 25 % most-attended downstream positions, a random set matched to it in
count and in distance from the decision token, the field, the sink; a dose-response over the
fraction masked (most attended first, and random sets of the same size); the top set per layer
third (decision variant). Each is summarised as a distribution (probes.parts.readouts) and as
decisions: `flip_share`, the share of items whose decision goes back to the old answer (the
pairwise decision score on the stale side of 0, over the items whose unmasked old and new
prompts decide differently; calibrated against the content-free score where records carry
`score_cf`), `flip_share_random` the same under the matched random keys, and the shares reaching
r >= 0.5 and moving away (r < 0), each with Wilson and domain-cluster intervals. FLIP_RULE decides
which variant reproduces the paper's "the decision reverts": flip_share's interval lies wholly
above flip_share_random's, each the wider of its Wilson and cluster intervals. It was written
after issue 31 had read the reference run (30/60 items reach r >= 0.5, random 0/60), to replace
REVERTS_RULE (fixed before any number was read), which counts only 0.5 <= r <= 1.5 and so reads a
two-peaked distribution as "not reproduced"; REVERTS_RULE is still reported. Attention mass of the
decision token is split into field / downstream / sink / other / self. Read heads:
probes.parts.heads. Paper: thirds early 0.00, mid 0.25, late 0.33, all 1.00; mass
field/downstream/sink 0.001/0.56/0.36; top-12 heads 0.72-0.82.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvnotes.edit.patching import PatchPair, metric_scores
from kvnotes.edit.ranking import matched_random, rank_by_attention
from kvnotes.engine import interp
from kvnotes.measure.metrics import ci_dict, recovery
from kvnotes.models.loading import LoadedModel
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.scoring import decision_logits
from kvnotes.tasks.scoring import score as item_score
from probes.parts.common import attention_to_cache, bands, item_fields, run_pairs, skip_summary
from probes.parts.heads import RANKINGS, head_records, summarize_heads
from probes.parts.readouts import (
    REVERTED,
    decision_shares,
    paired_difference,
    per_item,
    proportion,
    reversion_stats,
    reverted,
)

VARIANTS = ("decision", "after_notes")
REVERTS_RULE = (
    "a variant reproduces 'the decision reverts' when, over usable items, masking the top set gives "
    f"(1) a median signed reversion within [{REVERTED[0]}, {REVERTED[1]}], (2) at least half of the "
    f"items reverted (reversion within [{REVERTED[0]}, {REVERTED[1]}]) and (3) a paired difference "
    "top - matched random (draws averaged per item) whose 95 % bootstrap CI lies above 0"
)
FLIP_RULE = (
    "a variant reproduces 'the decision reverts' when masking the top set sends the decision back to the old "
    "answer (raw pairwise decision, over items whose old and new prompts decide differently) in a share whose "
    "95 % interval lies wholly above that of the matched random keys; each interval is the wider of the Wilson "
    "interval over items and the cluster bootstrap over domains"
)


@dataclass
class KnockoutConfig:
    margin: float | None = None
    top_fraction: float = 0.25  # the "most-attended" set: this share of downstream positions
    fractions: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.25, 0.5, 0.75, 1.0])
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    n_random: int = 3  # draws of the matched control and of random heads
    n_random_dose: int = 1  # draws of the random set at each dose (a full forward each in after_notes)
    match_width: int = 3  # matched control: a random pick among this many nearest in distance
    n_sink: int = 1  # the first positions count as the attention sink
    read_heads: bool = True
    head_ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    head_rankings: list[str] = field(default_factory=lambda: list(RANKINGS))
    n_heads: int = 12  # the paper's top-12: always on the curve, and reported on its own
    seed: int = 0
    batch_size: int = 64
    hide_batch_size: int = 4  # after_notes: full forwards per batch
    unit_size: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.top_fraction <= 0.5 or any(not 0 < f <= 1 for f in self.fractions):
            raise ValueError("top_fraction in (0, 0.5] (the matched control draws from the rest) "
                             "and fractions in (0, 1]")
        bad = [v for v in self.variants if v not in VARIANTS] + [r for r in self.head_rankings if r not in RANKINGS]
        if bad or not self.variants:
            raise ValueError(f"unknown variants/rankings {bad}; variants: {VARIANTS}, rankings: {RANKINGS}")
        if self.n_heads < 1 or any(k < 1 for k in self.head_ks) or self.n_sink < 0 or min(self.n_random, self.n_random_dose) < 0:
            raise ValueError("n_heads >= 1, head_ks >= 1, n_sink >= 0, n_random >= 0, n_random_dose >= 0")
        if self.match_width < 1 or self.batch_size < 1 or self.hide_batch_size < 1:
            raise ValueError("match_width, batch_size and hide_batch_size must be >= 1")


def mass_split(att: torch.Tensor, pair: PatchPair, n_sink: int) -> dict[str, float]:
    """Share of the decision token's attention (mean over layers and heads) on each region."""
    total = att.sum(-1).mean().item()  # the rest goes to the token itself

    def share(pos: list[int]) -> float:
        return float(att[..., pos].sum(-1).mean().item()) if pos else 0.0

    sink = list(range(min(n_sink, pair.item.field_span[0])))
    fld, down = pair.field_positions, pair.downstream_positions
    taken = set(sink + fld + down)
    other = [p for p in range(pair.n_cached) if p not in taken]
    return {"mass_field": share(fld), "mass_downstream": share(down), "mass_sink": share(sink),
            "mass_other": share(other), "mass_self": 1.0 - total}


KeySet = tuple[dict[str, Any], list[int], list[int]]  # (record fields, keys, layers)


def key_sets(pair: PatchPair, att: torch.Tensor, cfg: KnockoutConfig, rng: random.Random,
             n_layers: int) -> list[KeySet]:
    """Every masked key set of one item, most-attended order from the decision token's attention."""
    down, all_layers = pair.downstream_positions, list(range(n_layers))
    by_att = rank_by_attention(att, down)
    n_top = max(1, math.ceil(cfg.top_fraction * len(down)))
    top = by_att[:n_top]
    sets: list[KeySet] = [
        ({"condition": "top", "n_keys": n_top}, top, all_layers),
        ({"condition": "field", "n_keys": len(pair.field_positions)}, pair.field_positions, all_layers),
        ({"condition": "sink", "n_keys": cfg.n_sink}, list(range(cfg.n_sink)), all_layers),
    ]
    for d in range(cfg.n_random):
        keys = matched_random(top, down, pair.n_cached, rng, cfg.match_width)
        gap = float(np.mean(np.abs(np.sort(keys) - np.sort(top))))
        sets.append(({"condition": "random_matched", "n_keys": n_top, "draw": d, "distance_gap": gap},
                     keys, all_layers))
    for f in cfg.fractions:
        k = max(1, math.ceil(f * len(down)))
        sets.append(({"condition": "dose", "fraction": f, "n_keys": k}, by_att[:k], all_layers))
        sets += [({"condition": "dose_random", "fraction": f, "n_keys": k, "draw": d}, sorted(rng.sample(down, k)),
                  all_layers) for d in range(cfg.n_random_dose)]
    for name, lay in bands(n_layers).items():
        sets.append(({"condition": "band", "band": name, "n_keys": n_top}, top, lay))
    return sets


def _unique(sets: list[KeySet]) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """The distinct (keys, layers) of `sets` and, per set, the index of its reading (e.g. the 25 %
    dose is the top set, every random draw at 100 % is the whole span: each is run once)."""
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    for _, keys, lay in sets:
        seen.setdefault((tuple(sorted(keys)), tuple(lay)), len(seen))
    index = [seen[(tuple(sorted(keys)), tuple(lay))] for _, keys, lay in sets]
    return [(list(k), list(lay)) for k, lay in seen], index


def _decision_scores(model: LoadedModel, pair: PatchPair, sets: list[KeySet], cfg: KnockoutConfig) -> np.ndarray:
    distinct, index = _unique(sets)
    key_mask = torch.zeros(len(distinct), pair.n_cached, dtype=torch.bool)
    layer_mask = torch.zeros(len(distinct), model.n_layers, dtype=torch.bool)
    for i, (keys, lay) in enumerate(distinct):
        key_mask[i, keys] = True
        layer_mask[i, lay] = True
    scores = metric_scores(model, pair.new, pair.new, pair.metric, int(pair.tail[0, -1]), [[]] * len(distinct),
                           key_mask=key_mask, mask_layers=layer_mask, batch_size=cfg.batch_size)
    return scores[index]


def _after_notes_scores(model: LoadedModel, pair: PatchPair, sets: list[KeySet], cfg: KnockoutConfig) -> np.ndarray:
    distinct, index = _unique(sets)
    n = pair.item.n_tokens

    def run(tail: list[int], vocab: tuple[int, ...] | None) -> torch.Tensor:  # the prompt, then the term's continuation
        hidden = torch.zeros(len(distinct), n - 1 + len(tail), dtype=torch.bool)
        for i, (keys, _) in enumerate(distinct):
            hidden[i, keys] = True
        ids = list(pair.item.new_ids[:-1]) + tail
        logits = interp.hide_keys(model, ids, hidden, cfg.hide_batch_size, keep=len(tail))  # [n, tail, vocab]
        return logits if vocab is None else logits[..., list(vocab)]
    return pair.metric.read(run, int(pair.tail[0, -1])).cpu().numpy().astype(np.float64)[index]


def item_records(model: LoadedModel, pair: PatchPair, cfg: KnockoutConfig, margin: float) -> list[dict[str, Any]]:
    item = pair.item
    rng = random.Random(f"{cfg.seed}/{item.item_id}")
    att = attention_to_cache(model, pair)  # [layer, head, pos]
    base = item_fields(item) | {"margin": margin, "score_stale": pair.score_stale,
                                "score_oracle": pair.score_oracle, "n_downstream": len(pair.downstream_positions)}
    if item.cf_ids is not None:  # the content-free prompt's score: the offset of a calibrated decision
        base["score_cf"] = item_score(item, decision_logits(model, item, calibrate=True)[2])
    rows: list[dict[str, Any]] = [base | {"condition": "mass", **mass_split(att, pair, cfg.n_sink)}]
    sets = key_sets(pair, att, cfg, rng, model.n_layers)
    for variant in cfg.variants:
        chosen = sets if variant == "decision" else [s for s in sets if s[0]["condition"] != "band"]
        scores = (_decision_scores if variant == "decision" else _after_notes_scores)(model, pair, chosen, cfg)
        rev = np.atleast_1d(recovery(scores, pair.score_oracle, pair.score_stale))  # 1 = back to stale
        for (row, _, _), s, r in zip(chosen, scores, rev, strict=True):
            rows.append(base | row | {"variant": variant, "score": float(s), "reversion": float(r),
                                      "reverted": reverted(r), "overshoot": bool(r > REVERTED[1]),
                                      "away": bool(r < 0)})
    if cfg.read_heads:
        ks = sorted(set(cfg.head_ks) | {cfg.n_heads})
        rows += head_records(model, pair, att, ks, cfg.head_rankings, cfg.n_random, rng, base, cfg.batch_size)
    return rows


def run(model: LoadedModel, items: Sequence[TaskItem], cfg: KnockoutConfig) -> list[dict[str, Any]]:
    return run_pairs(model, items, cfg.margin, lambda pair, m: item_records(model, pair, cfg, m))


def _rev(records: Sequence[Mapping[str, Any]], variant: str, cond: str, **eq: Any) -> dict[str, float]:
    """item -> reversion (random draws averaged per item) of one condition in one variant."""
    def keep(r: Mapping[str, Any]) -> bool:
        return (r.get("condition") == cond and r.get("variant", "decision") == variant
                and all(r.get(k) == v for k, v in eq.items()))
    return per_item(records, keep, "reversion")


def reproduces(top: Mapping[str, Any], diff: Mapping[str, Any]) -> bool | None:
    """REVERTS_RULE on one variant's summaries; None when no item was usable."""
    if not top["n"]:
        return None
    return bool(REVERTED[0] <= top["median"] <= REVERTED[1] and top["share_reverted"]["mean"] >= 0.5
                and diff["ci_lo"] > 0)


def _rows(records: Sequence[Mapping[str, Any]], variant: str, cond: str) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("condition") == cond and r.get("variant", "decision") == variant]


def flips_reproduce(flip: Mapping[str, Any], flip_random: Mapping[str, Any]) -> bool | None:
    """FLIP_RULE on one variant's flip shares; None when no item could flip (or no control)."""
    if not flip.get("n") or not flip_random.get("n"):
        return None
    return bool(flip["verdict_ci"][0] > flip_random["verdict_ci"][1])


def summarize_variant(records: Sequence[Mapping[str, Any]], variant: str) -> dict[str, Any]:
    out: dict[str, Any] = {c: reversion_stats(_rev(records, variant, c).values()) for c in ("top", "field", "sink")}
    top, rand = _rev(records, variant, "top"), _rev(records, variant, "random_matched")
    out["random_matched"] = reversion_stats(rand.values())
    out["top_minus_random"] = paired_difference(top, rand)
    gaps = per_item(records, lambda r: r.get("condition") == "random_matched"
                    and r.get("variant", "decision") == variant, "distance_gap")
    out["matched_distance_gap"] = ci_dict(gaps.values())  # tokens; 0 = same distances as the top set
    fracs = sorted({float(r["fraction"]) for r in records if r.get("condition") == "dose"
                    and r.get("variant", "decision") == variant})
    out["dose"] = [{"fraction": f, "top": reversion_stats(_rev(records, variant, "dose", fraction=f).values()),
                    "random": reversion_stats(_rev(records, variant, "dose_random", fraction=f).values())}
                   for f in fracs]
    out["reproduces_reverts"] = reproduces(out["top"], out["top_minus_random"])
    out["decisions"] = {c: decision_shares(_rows(records, variant, c)) for c in ("top", "random_matched")}
    top_d, rand_d = out["decisions"]["top"], out["decisions"]["random_matched"]
    out["flip_share"], out["flip_share_random"] = top_d["flip"], rand_d["flip"]
    out["flip_share_calibrated"], out["flip_share_random_calibrated"] = (top_d["flip_calibrated"],
                                                                         rand_d["flip_calibrated"])
    out["reproduces_flip"] = flips_reproduce(top_d["flip"], rand_d["flip"])
    return out


def summarize(records: Sequence[Mapping[str, Any]], cfg: KnockoutConfig) -> dict[str, Any]:
    out = skip_summary(records)
    mass = [r for r in records if r.get("condition") == "mass"]
    out["mass"] = {k: ci_dict(float(r[k]) for r in mass) for k in
                   ("mass_field", "mass_downstream", "mass_sink", "mass_other", "mass_self")}
    present = [v for v in VARIANTS if any(r.get("variant", "decision") == v and r.get("condition") == "top"
                                          for r in records)]
    for v in present:
        out[v] = summarize_variant(records, v)
    out["reverts_rule"] = REVERTS_RULE  # the old window rule, kept for old readers
    out["reverts_reproduced_by"] = [v for v in present if out[v]["reproduces_reverts"]]
    out["flip_rule"] = FLIP_RULE
    out["flip_reproduced_by"] = [v for v in present if out[v]["reproduces_flip"]]
    band = [r for r in records if r.get("condition") == "band"]
    out["bands"] = [{"band": b, "reverted": proportion(bool(r["reverted"]) for r in band if r["band"] == b),
                     **{k: v for k, v in reversion_stats(float(r["reversion"]) for r in band if r["band"] == b).items()
                        if k in ("median", "share_overshoot", "share_away")},
                     "flip_share": decision_shares([r for r in band if r["band"] == b])["flip"]}
                    for b in ("early", "mid", "late", "all") if any(r["band"] == b for r in band)]
    if any(r.get("condition") == "heads" for r in records):
        out["heads"] = summarize_heads(records, cfg.n_heads)
    if present:
        out["reading"] = reading(out, present, cfg.top_fraction)
    return out


def reading(out: Mapping[str, Any], present: Sequence[str], top_fraction: float) -> str:
    """One line: the flip share of the top set per variant against its matched random keys, and
    which variant reproduces the claim."""
    def cell(s: Mapping[str, Any]) -> str:
        lo, hi = s.get("verdict_ci", [math.nan, math.nan])
        return f"{s.get('k', 0)}/{s.get('n', 0)} [{lo:.2f}, {hi:.2f}]"
    parts = [f"{'decision token only' if v == 'decision' else 'every later query'} {cell(out[v]['flip_share'])} "
             f"(matched random {cell(out[v]['flip_share_random'])}; median reversion {out[v]['top']['median']:.2f})"
             for v in present]
    who = ", ".join(out["flip_reproduced_by"]) or "neither variant"
    return (f"top {100 * top_fraction:g} % most-attended keys masked, decisions back to the old answer: "
            f"{'; '.join(parts)}; 'the decision reverts' is reproduced by {who} (rule: flip_rule)")


# The job convention (runner/jobs.py): the runner finds this probe by these names.
NAME = "knockout"
CONFIG = KnockoutConfig
HELP = "circuit knockout: signed reversion vs matched random keys, two mask variants; read-head curves"
