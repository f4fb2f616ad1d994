"""The instruments on one prompt pair: patching maps, recoveries, attribution with its exact
check, and attention knockout against matched random keys. Each returns a tidy DataFrame.

Every instrument prefills the pair once (`prepare`; pass the PatchPair it returns to reuse the
caches), applies the usable-pair gate (|clean - corrupt| of the metric against the model's
margin or `margin=`: below it a `UnusablePairWarning` and recoveries NaN, the raw score changes
still reported) and reads patched states through kvnotes.edit.patching. Columns: `effect` is the
raw change of the metric (patched - corrupt, in its units: logits for a logit difference);
`recovery` = effect / (clean - corrupt). Knockout runs on the clean cache: `reversion` = (clean -
score) / (clean - corrupt), 1 = back at the corrupt score.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr

from kvnotes.edit import ranking
from kvnotes.edit.attribution import attribute_cache, top_positions
from kvnotes.edit.patching import (
    PatchPair,
    head_scores,
    make_pair,
    metric_scores,
    patched_scores,
)
from kvnotes.engine import interp
from kvnotes.errors import UnusablePairWarning
from kvnotes.measure import margins
from kvnotes.measure.metrics import recovery as recovery_of
from kvnotes.models.loading import LoadedModel

OVER = ("position", "layer", "position_layer", "head")


def prepare(model: LoadedModel, pair: Any) -> PatchPair:
    """The corrupt (stale) and clean (oracle) caches of a Pair or TaskItem, and their scores."""
    return pair if isinstance(pair, PatchPair) else make_pair(model, pair)


def gate(model: LoadedModel, pp: PatchPair, margin: float | None = None) -> tuple[float, str | None]:
    """(margin, reason): the model's margin unless `margin` is given, and why the pair is unusable
    (warned once per call), or None."""
    m = model.margin if margin is None else float(margin)
    reason = margins.unusable(pp.delta, m)
    if reason:
        warnings.warn(f"{pp.item.item_id}: {reason}: the metric barely moves between the prompts, so its "
                      "recoveries are reported as NaN (pass margin= to judge by another threshold)",
                      UnusablePairWarning, stacklevel=3)
    return m, reason


def _recovery(pp: PatchPair, scores: np.ndarray, unusable: str | None) -> np.ndarray:
    if unusable:
        return np.full(len(scores), np.nan)
    return np.atleast_1d(np.asarray(recovery_of(scores, pp.score_stale, pp.score_oracle), dtype=np.float64))


def segment_names(pair: Any) -> list[str]:
    """The segment of every prompt position: `before` the field, `field`, the named spans
    (the first that holds it), else `notes` (after the field), the last token `decision`."""
    s, e = pair.field_span
    out = ["before"] * s + ["field"] * (e - s) + ["notes"] * (pair.n_tokens - e)
    for name, (a, b) in pair.segments.items():
        for p in range(max(a, e), b):
            if out[p] == "notes":
                out[p] = name
    out[-1] = "decision"
    return out


def _tokens(model: LoadedModel, ids: Sequence[int]) -> list[str]:
    tok = model.tokenizer
    return [tok.decode([i]) for i in ids] if tok is not None else [""] * len(ids)


def _frame(model: LoadedModel, pp: PatchPair, rows: list[dict[str, Any]], scores: np.ndarray,
           unusable: str | None, margin: float, **attrs: Any) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    df["score"] = scores
    df["effect"] = scores - pp.score_stale
    df["recovery"] = _recovery(pp, scores, unusable)
    df.insert(0, "pair_id", pp.item.item_id)
    df.attrs.update(score_corrupt=pp.score_stale, score_clean=pp.score_oracle, delta=pp.delta, margin=margin,
                    usable=unusable is None, unusable=unusable, metric=pp.metric.name, **attrs)
    return df


def _position_rows(model: LoadedModel, pp: PatchPair, positions: Sequence[int]) -> list[dict[str, Any]]:
    seg, tok = segment_names(pp.item), _tokens(model, pp.item.new_ids)  # the clean tokens: what is patched in
    return [{"position": p, "token": tok[p], "segment": seg[p]} for p in positions]


def patch_map(model: LoadedModel, pair: Any, over: str = "position", margin: float | None = None,
              batch_size: int | None = None) -> pd.DataFrame:
    """Clean K/V patched into the corrupt cache, one unit at a time: each `position` (all layers),
    each `layer` (the notes, every position after the field), each `position_layer` cell, or each
    query `head`'s output at the decision token (its read). Positions before the field hold the
    same K/V in both runs: their rows are exact zeros without a forward."""
    if over not in OVER:
        raise ValueError(f"over={over!r}; valid: {', '.join(OVER)}")
    pp = prepare(model, pair)
    m, why = gate(model, pp, margin)
    if over == "head":
        return _head_map(model, pp, m, why, batch_size)
    cand = pp.field_to_end
    if over == "layer":
        layers = list(range(model.n_layers))
        s = patched_scores(model, pp, [pp.downstream_positions] * len(layers), [[la] for la in layers],
                           batch_size=batch_size)
        return _frame(model, pp, [{"layer": la, "rel_layer": la / max(1, len(layers) - 1)} for la in layers],
                      s, why, m)
    if over == "position":
        s = np.full(pp.n_cached, pp.score_stale)
        s[cand] = patched_scores(model, pp, [[p] for p in cand], batch_size=batch_size)
        return _frame(model, pp, _position_rows(model, pp, range(pp.n_cached)), s, why, m)
    cells = [(p, la) for p in cand for la in range(model.n_layers)]
    s = patched_scores(model, pp, [[p] for p, _ in cells], [[la] for _, la in cells], batch_size=batch_size)
    rows = _position_rows(model, pp, [p for p, _ in cells])
    for r, (_, la) in zip(rows, cells, strict=True):
        r["layer"] = la
    return _frame(model, pp, rows, s, why, m)


def _head_map(model: LoadedModel, pp: PatchPair, m: float, why: str | None, batch_size: int | None) -> pd.DataFrame:
    z_new = interp.tail_head_outputs(model, pp.new, pp.tail)  # [layer, head, d_head]
    L, H = int(z_new.shape[0]), int(z_new.shape[1])
    masks = torch.eye(L * H, dtype=torch.bool).reshape(L * H, L, H)  # one head per variant
    rows = [{"layer": la, "head": h} for la in range(L) for h in range(H)]
    return _frame(model, pp, rows, head_scores(model, pp, z_new, masks, batch_size or 64), why, m)


def recoveries(model: LoadedModel, pair: Any, spans: Mapping[str, Sequence[int] | tuple[int, int]] | None = None,
               margin: float | None = None, batch_size: int | None = None) -> pd.DataFrame:
    """Recovery of the standard patches (corrupt, field only, notes only, field and notes, clean)
    and of each named span (the pair's own spans and `spans`: a (start, end) token span or a list
    of positions), one row each."""
    pp = prepare(model, pair)
    m, why = gate(model, pp, margin)
    named = {k: list(range(*v)) for k, v in pp.item.segments.items()}
    for k, v in (spans or {}).items():
        named[k] = list(range(v[0], v[1])) if isinstance(v, tuple) else [int(p) for p in v]
    states = {"corrupt": [], "field_only": pp.field_positions, "notes_only": pp.downstream_positions,
              "full_downstream": pp.field_to_end, "clean": list(range(pp.n_cached))}
    states |= {k: [p for p in v if p < pp.n_cached] for k, v in named.items()}
    s = patched_scores(model, pp, list(states.values()), batch_size=batch_size)
    rows = [{"condition": k, "n_positions": len(v)} for k, v in states.items()]
    return _frame(model, pp, rows, s, why, m)


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 3 or np.ptp(a[ok]) == 0 or np.ptp(b[ok]) == 0:
        return float("nan")
    return float(spearmanr(a[ok], b[ok]).statistic)


def attribution_map(model: LoadedModel, pair: Any, over: str = "position", check_top: int = 8,
                    margin: float | None = None, batch_size: int | None = None) -> pd.DataFrame:
    """Attribution patching over the cache (one forward and one backward; keys with AtP*'s QK fix,
    `estimate`, and linear, `estimate_linear`), per `position` or `position_layer` cell, with the
    exact effect of the `check_top` entries it ranks highest (`exact`; NaN elsewhere) and, per
    position, the exact map of every position (cheap): attrs `spearman` (estimate vs exact over the
    field and after) and `top_overlap` (shared entries of the two top-`check_top` sets)."""
    if over not in ("position", "position_layer"):
        raise ValueError(f"over={over!r}; valid: position, position_layer")
    pp = prepare(model, pair)
    m, why = gate(model, pp, margin)
    amap = attribute_cache(model, pp)
    cand = pp.field_to_end
    if over == "position":
        est, lin = amap.per_position("qk"), amap.per_position("linear")
        exact = np.full(pp.n_cached, pp.score_stale)
        exact[cand] = patched_scores(model, pp, [[p] for p in cand], batch_size=batch_size)
        eff = exact - pp.score_stale
        top_est, top_exact = top_positions(est, check_top, cand), top_positions(eff, check_top, cand)
        df = _frame(model, pp, _position_rows(model, pp, range(pp.n_cached)), exact, why, m)
        df = df.rename(columns={"score": "exact_score", "effect": "exact", "recovery": "exact_recovery"})
        df.insert(4, "estimate", est)
        df.insert(5, "estimate_linear", lin)
        df["estimate_recovery"] = _recovery(pp, pp.score_stale + est, why)
        df.attrs.update(spearman=_spearman(est[cand], eff[cand]), spearman_linear=_spearman(lin[cand], eff[cand]),
                        top_overlap=len(set(top_est) & set(top_exact)) / max(1, min(check_top, len(cand))),
                        check_top=check_top)
        return df
    est2, lin2 = amap.per_position_layer("qk"), amap.per_position_layer("linear")  # [pos, layer]
    cells = [(p, la) for p in cand for la in range(model.n_layers)]
    e = np.array([est2[p, la] for p, la in cells])
    top = sorted(range(len(cells)), key=lambda i: (-e[i], i))[:check_top]
    s = patched_scores(model, pp, [[cells[i][0]] for i in top], [[cells[i][1]] for i in top], batch_size=batch_size)
    exact = np.full(len(cells), np.nan)
    exact[top] = s - pp.score_stale
    rows = _position_rows(model, pp, [p for p, _ in cells])
    for r, (_, la), i in zip(rows, cells, range(len(cells)), strict=True):
        r |= {"layer": la, "estimate": e[i], "estimate_linear": lin2[cells[i]]}
    df = pd.DataFrame(rows)
    df["exact"] = exact
    df["estimate_recovery"] = _recovery(pp, pp.score_stale + e, why)
    df["exact_recovery"] = _recovery(pp, pp.score_stale + exact, why)
    df.insert(0, "pair_id", pp.item.item_id)
    df.attrs.update(score_corrupt=pp.score_stale, score_clean=pp.score_oracle, delta=pp.delta, margin=m,
                    usable=why is None, unusable=why, metric=pp.metric.name, check_top=check_top,
                    spearman_checked=_spearman(e[top], exact[top]),
                    sign_agree_checked=float(np.mean(np.sign(e[top]) == np.sign(exact[top]))) if top else np.nan)
    return df


def knockout(model: LoadedModel, pair: Any, positions: Sequence[int] | None = None,
             heads: Sequence[int] | None = None, layers: Sequence[int] | None = None, n_random: int = 8,
             top_fraction: float = 0.25, seed: int = 0, match_width: int = 3, margin: float | None = None,
             batch_size: int | None = None) -> pd.DataFrame:
    """Hide keys from the decision token's attention on the clean cache (at `layers` and query
    `heads`; None: all) and read how far the metric goes back to the corrupt score. `positions`:
    the keys hidden (default: the `top_fraction` of the notes the decision token attends to most);
    beside them `n_random` sets matched in count and distance from the decision token, drawn from
    the notes. attrs: `reversion` of the chosen set, the random draws' mean, and `p_random` =
    (1 + draws reverting at least as far) / (1 + n_random)."""
    pp = prepare(model, pair)
    m, why = gate(model, pp, margin)
    down = pp.downstream_positions
    att = ranking.decision_attention(model, pp)
    chosen = sorted(int(p) % pp.n_cached for p in positions) if positions is not None else \
        ranking.top_attended(att, down, top_fraction)
    rng = random.Random(f"{seed}/{pp.item.item_id}")
    draws = [ranking.matched_random(chosen, down, pp.n_cached, rng, match_width) for _ in range(n_random)]
    sets = [chosen, *draws]
    key_mask = torch.zeros(len(sets), pp.n_cached, dtype=torch.bool)
    for i, keys in enumerate(sets):
        key_mask[i, keys] = True
    layer_mask = None
    if layers is not None:
        layer_mask = torch.zeros(len(sets), model.n_layers, dtype=torch.bool)
        layer_mask[:, list(layers)] = True
    head_mask = None
    if heads is not None:
        head_mask = torch.zeros(len(sets), model.adapter.n_heads(model.hf), dtype=torch.bool)
        head_mask[:, list(heads)] = True
    s = metric_scores(model, pp.new, pp.new, pp.metric, int(pp.tail[0, -1]), [[]] * len(sets), key_mask=key_mask,
                      mask_layers=layer_mask, mask_heads=head_mask, batch_size=batch_size)
    rev = np.full(len(s), np.nan) if why else np.atleast_1d(recovery_of(s, pp.score_oracle, pp.score_stale))
    rows = [{"condition": "chosen" if i == 0 else "random_matched", "draw": i - 1 if i else None,
             "n_keys": len(k), "keys": list(k)} for i, k in enumerate(sets)]
    df = _frame(model, pp, rows, s, why, m)
    df["effect"] = s - pp.score_oracle  # the change from the clean score
    df = df.drop(columns="recovery").assign(reversion=rev)
    beaten = int(np.sum(rev[1:] >= rev[0])) if n_random and not why else 0
    df.attrs.update(reversion=float(rev[0]), reversion_random=float(np.mean(rev[1:])) if n_random else np.nan,
                    p_random=(1 + beaten) / (1 + n_random) if n_random and not why else np.nan,
                    layers=None if layers is None else list(layers), heads=None if heads is None else list(heads))
    return df
