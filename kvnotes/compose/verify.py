"""Per-model go / no-go for composition: can cached keys be moved by one rotation here, and does a
transplant with seam repair stay close to a full prefill?

1. Facts relied on: every layer's rope type and scaling (only kvnotes.models.rope_types.STATIC_ROPE_TYPES
   can be re-rotated), the attention scaling divided out, and the sliding windows (with whether
   the probe prompts outrun them, so that the masks were exercised).
2. RoPE: relative key error e = max|a - b| / max|b| over layers of a round trip (rotate by +d
   then -d) and of rotate vs prefill-at-offset (a block prefilled at 0 and rotated by d against
   the same block prefilled at positions d..; attention only sees relative positions, so they
   agree to rounding when the rotation is right), for d in {1, 37, one past the original context}.
3. Splice: N probe prompts (a head, three filler blocks, a question); blocks transplanted with
   seam K in {0, 2, 8}; last-position logit cosine, top-1 and KL(full || spliced) against a full
   prefill; exactness of K = L (the full prefill's cache) and of prefill + extend (a forward).
Go when every fact is supported, both rope errors and both exactness diffs are within the
dtype's THRESHOLDS and (real weights only: a random tiny model has no fidelity to judge) the mean
cosine at the largest K reaches `cosine`. `require_go` is the gate a transplant caller uses.

    kvnotes verify llama [--dtype float32] [--probes 4] [--json out.json]   (= python -m kvnotes.compose.verify)
    kvnotes verify --all        # every registered model; tiny configs for hub-only ones

This is not the weights' integrity check: `kvnotes models verify NAME` re-hashes the weight files
against their recorded sha256 (seconds); this one runs the model (minutes on a CPU for a real
model) and says whether composing cached blocks is safe on it. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvnotes.compose import splice as compose
from kvnotes.compose.blend import Layout
from kvnotes.engine import rope, run
from kvnotes.errors import KvnotesError
from kvnotes.measure.metrics import kl_divergence, logit_cosine, top1_agree
from kvnotes.models import get_spec, load_model, model_names, resolve_dtype
from kvnotes.models.loading import LoadedModel
from kvnotes.models.tiny import tiny_model
from kvnotes.models.weights import is_converted
from kvnotes.models.wheels import WeightsError, cache_dir
from kvnotes.tasks import filler
from kvnotes.tasks.tokens import encode, frame

log = logging.getLogger(__name__)
SEAMS = (0, 2, 8)
INTRO = "You are a careful assistant. Read the notes below, then answer.\n\n"
QUESTION = "Question: which note sets a deadline, and what is it?\nAnswer in a few words."
WEIGHTS_CHECK = "kvnotes models verify"  # the other `verify`: sha256 of the weight files
Progress = Callable[[str], None]  # told one line per step of a verification


def _quiet(_: str) -> None:
    """The default progress: say nothing (the library does not print)."""


@dataclass(frozen=True)
class Thresholds:
    """What `go` demands in one dtype (stated here, reported with every verdict)."""

    rope_rel: float  # relative key error of the round trip and of rotate vs prefill-at-offset
    exact_atol: float  # max |diff| of K = L splice vs full prefill, prefill + extend vs forward
    cosine: float = 0.85  # mean logit cosine at the largest seam K: is a transplant worth using
    # A wrong rotation is caught by rope_rel, not by the cosine: on llama, blocks left unrotated
    # at 0..L-1 still score 0.95 against a full prefill (K = 0 rotated correctly: 0.89-0.92).


THRESHOLDS = {
    "float32": Thresholds(rope_rel=1e-3, exact_atol=1e-3),
    "float16": Thresholds(rope_rel=1e-2, exact_atol=0.1),
    "bfloat16": Thresholds(rope_rel=5e-2, exact_atol=0.5),
}


class NoGoError(KvnotesError, RuntimeError):
    """Verification said no-go for this model; the message gives the reasons."""


@dataclass
class Report:
    model: str
    family: str
    dtype: str
    real_weights: bool
    thresholds: Thresholds
    facts: list[dict[str, Any]] = field(default_factory=list)
    rope: dict[str, Any] = field(default_factory=dict)
    splice: list[dict[str, Any]] = field(default_factory=list)
    exact: dict[str, float] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    @property
    def go(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"go": self.go}

    def lines(self) -> list[str]:
        """The report as text lines (facts, rope, splice, verdict)."""
        t = self.thresholds
        out = [f"{self.model} ({self.family}, {self.dtype}, "
               f"{'real weights' if self.real_weights else 'random tiny config'})"]
        for f in _fact_groups(self.facts):
            out.append(f"  facts  {f}")
        if "window_exercised" in self.rope:
            out.append(f"  facts  probe prompts longer than the shortest sliding window: "
                       f"{self.rope['window_exercised']}")
        if self.rope:
            out.append(f"  rope   round trip {self.rope['roundtrip_rel']:.2e}, rotate vs prefill at "
                       f"offset {self.rope['offset_rel']:.2e} (d = {self.rope['deltas']}; <= {t.rope_rel:g})")
        if self.exact:
            out.append(f"  exact  K = L splice {self.exact['splice_full']:.2e}, prefill + extend "
                       f"{self.exact['extend']:.2e} (<= {t.exact_atol:g})")
        for s in self.splice:
            out.append(f"  splice K = {s['seam']:<2d} cosine {s['cosine']:.4f} (min {s['cosine_min']:.4f}), "
                       f"top-1 {s['top1']:.2f}, KL {s['kl']:.4f}, n = {s['n']}")
        verdict = "GO" if self.go else "NO-GO: " + "; ".join(self.reasons)
        out.append(f"  verdict {verdict}")
        return out

    def row(self) -> str:
        """One markdown table row: model, dtype, rope errors, cosine per K, verdict."""
        cos = {s["seam"]: s["cosine"] for s in self.splice}
        cells = [self.model + ("" if self.real_weights else " (tiny config)"), self.dtype,
                 f"{self.rope['roundtrip_rel']:.1e}" if self.rope else "-",
                 f"{self.rope['offset_rel']:.1e}" if self.rope else "-",
                 *[f"{cos[k]:.4f}" if k in cos else "-" for k in SEAMS],
                 "go" if self.go else "no-go"]
        return "| " + " | ".join(cells) + " |"


TABLE_HEAD = ("| model | dtype | rope round trip | rotate vs offset | "
              + " | ".join(f"cosine K={k}" for k in SEAMS) + " | verdict |\n|"
              + "---|" * (5 + len(SEAMS)))


def _fact_groups(facts: list[dict[str, Any]]) -> list[str]:
    """Layers with identical facts, summarised once each."""
    groups: dict[str, list[int]] = {}
    for f in facts:
        key = (f"{f['layer_type']}: rope {f['rope_type']} theta {f['rope_theta']}"
               + (f" factor {f['factor']}" if f["factor"] else "")
               + (f" original ctx {f['original_max_position_embeddings']}" if f["original_max_position_embeddings"] else "")
               + (f" attention scaling {f['attention_scaling']:.4g} (divided out)" if f["attention_scaling"] != 1.0 else "")
               + (f", sliding window {f['sliding_window']}" if f["sliding_window"] else ", full attention")
               + ("" if f["supported"] else " UNSUPPORTED"))
        groups.setdefault(key, []).append(int(f["layer"]))
    return [f"layers {_ranges(v)}: {k}" for k, v in groups.items()]


def _ranges(xs: list[int]) -> str:
    return f"{xs[0]}-{xs[-1]}" if xs == list(range(xs[0], xs[-1] + 1)) and len(xs) > 1 else ",".join(map(str, xs))


# --- the checks ---------------------------------------------------------------------------------


def probe_layouts(model: LoadedModel, n: int, block_tokens: int = 96, seed: int = 0) -> list[Layout]:
    """n probe prompts: chat head + intro, three filler blocks of ~block_tokens, a question."""

    tok = model.tokenizer
    fr = frame(tok, model.chat)
    head = tuple(encode(tok, fr.head + INTRO))
    tail = tuple(encode(tok, fr.mid + QUESTION + fr.tail + "Answer:"))
    out = []
    for i in range(n):
        blocks = []
        for j in range(3):
            lines = filler.fit(tok, filler.filler_stream(random.Random(f"verify:{seed}:{i}:{j}")), block_tokens)
            blocks.append(tuple(t for line in [f"## Note {j + 1}\n", *lines] for t in encode(tok, line)))
        out.append(Layout(head, tuple(blocks), tail))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def rope_errors(model: LoadedModel, block: tuple[int, ...], deltas: list[int],
                progress: Progress = _quiet) -> dict[str, Any]:
    """Max over layers and deltas of the round-trip and rotate-vs-prefill-at-offset key errors."""
    alone = run.prefill(model, list(block)).cache
    trip = off = 0.0
    for i, d in enumerate(deltas):
        progress(f"rope: rotate by d = {d} and back, against a prefill at offset d ({i + 1}/{len(deltas)})")
        moved = rope.reposition(model, alone, d)
        back = rope.reposition(model, moved, -d)
        at = run.prefill_at(model, block, d)
        trip = max(trip, *(_rel(a, b) for a, b in zip(back.keys, alone.keys)))
        off = max(off, *(_rel(a, b) for a, b in zip(moved.keys, at.keys)))
    return {"roundtrip_rel": trip, "offset_rel": off, "deltas": deltas}


def splice_fidelity(model: LoadedModel, layouts: list[Layout], seams: tuple[int, ...] = SEAMS,
                    progress: Progress = _quiet) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per seam K: mean / min cosine, top-1 rate, mean KL over the probes; exactness diffs."""
    per: dict[int, list[tuple[float, bool, float]]] = {k: [] for k in seams}
    exact = {"splice_full": 0.0, "extend": 0.0}
    for i, lay in enumerate(layouts):
        progress(f"splice: probe prompt {i + 1}/{len(layouts)} ({len(lay.ids)} tokens), "
                 f"transplanted with seams K = {', '.join(map(str, seams))}")
        full = run.prefill(model, lay.ids)
        ref = full.logits[0, -1]  # [vocab]
        fwd = run.full_logits(model, lay.ids)[0, -1]
        head = run.prefill(model, list(lay.head)).cache if lay.head else None
        blocks = [compose.prefill_block(model, list(b)) for b in lay.blocks]
        whole = compose.transplant(model, head, blocks, max(len(b) for b in lay.blocks))
        exact["splice_full"] = max(exact["splice_full"],
                                   whole.max_abs_diff(full.cache.slice(0, len(lay.context))))
        exact["extend"] = max(exact["extend"], float((ref - fwd).abs().max()))
        for k in seams:
            logits = run.extend(model, compose.transplant(model, head, blocks, k), list(lay.tail)).logits[0, -1]
            per[k].append((float(logit_cosine(logits, ref)), bool(top1_agree(logits, ref)),
                           float(kl_divergence(ref, logits))))
    rows = []
    for k, v in per.items():
        c, t, kl = zip(*v)
        rows.append({"seam": k, "cosine": sum(c) / len(c), "cosine_min": min(c),
                     "top1": sum(t) / len(t), "kl": sum(kl) / len(kl), "n": len(v)})
    return rows, exact


def verify(model: LoadedModel, n_probes: int = 4, seams: tuple[int, ...] = SEAMS,
           judge_fidelity: bool | None = None, thresholds: Thresholds | None = None,
           seed: int = 0, progress: Progress = _quiet) -> Report:
    """Facts, rope errors, splice fidelity and the verdict for `model` (see the module docstring).

    `judge_fidelity` None: judge the splice cosine for registered (real) models only;
    `thresholds` None: THRESHOLDS of the model's dtype; `progress` is told one line per step.
    """
    if n_probes < 1:
        raise ValueError(f"n_probes must be >= 1, got {n_probes}")
    if not seams or any(k < 0 for k in seams):
        raise ValueError(f"seams must be a non-empty tuple of ints >= 0, got {seams}")
    dtype = str(model.dtype).removeprefix("torch.")
    real = model.spec is not None if judge_fidelity is None else judge_fidelity
    t = thresholds or THRESHOLDS.get(dtype, THRESHOLDS["float32"])
    rep = Report(model.name, model.adapter.family, dtype, real, t)
    rep.facts = rope.rope_facts(model)
    progress(f"facts: rope type and scaling of {len(rep.facts)} layers")
    bad = [f for f in rep.facts if not f["supported"]]
    if bad:
        rep.reasons.append(bad[0]["unsupported_reason"])
        return rep  # every rotation would raise: nothing more to measure
    layouts = probe_layouts(model, n_probes, seed=seed)
    block = layouts[0].blocks[0]
    max_pos = int(getattr(model.config, "max_position_embeddings", 4096) or 4096)
    originals = [int(f["original_max_position_embeddings"]) for f in rep.facts if f["original_max_position_embeddings"]]
    far = max(originals) + 1 if originals else 1000
    deltas = sorted({1, 37, min(far, max_pos - len(block) - 1)})
    rep.rope = rope_errors(model, block, deltas, progress)
    rep.splice, rep.exact = splice_fidelity(model, layouts, seams, progress)
    windows = [f["sliding_window"] for f in rep.facts if f["sliding_window"]]
    if windows:
        rep.rope["window_exercised"] = len(layouts[0].ids) > min(windows)
    for name in ("roundtrip_rel", "offset_rel"):
        if not rep.rope[name] <= t.rope_rel:
            rep.reasons.append(f"rope {name} {rep.rope[name]:.2e} > {t.rope_rel:g}")
    for name, v in rep.exact.items():
        if not v <= t.exact_atol:
            rep.reasons.append(f"exactness {name} {v:.2e} > {t.exact_atol:g}")
    last = max(rep.splice, key=lambda s: s["seam"])
    if real and not last["cosine"] >= t.cosine:
        rep.reasons.append(f"splice cosine {last['cosine']:.4f} at K = {last['seam']} < {t.cosine:g}")
    return rep


# model -> (dtype, device) -> its verdict; weakly keyed on the module itself, not on id(): a freed
# model's id can be reused by the next one, which would then inherit the freed model's verdict
_VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[str, str], Report]] = weakref.WeakKeyDictionary()


def require_go(model: LoadedModel, force: bool = False, **kwargs: Any) -> Report:
    """The verification of `model` (run once per model object); raises NoGoError on no-go unless
    `force`, in which case the report is returned and a warning logged."""
    known = _VERDICTS.setdefault(model.hf, {})
    key = (str(model.dtype), str(model.device))
    if key not in known:
        known[key] = verify(model, **kwargs)
    rep = known[key]
    if not rep.go:
        msg = f"verification of {model.name} says no-go: {'; '.join(rep.reasons)}"
        if not force:
            raise NoGoError(msg + " (force=True transplants anyway)")
        log.warning("%s; forced", msg)
    return rep


# --- command line -------------------------------------------------------------------------------


def _load(name: str, dtype: str, device: str) -> LoadedModel:
    if name.startswith("tiny-"):
        return tiny_model(name.removeprefix("tiny-"), dtype=resolve_dtype(dtype))
    return load_model(name, device=device, dtype=dtype)


def _targets() -> list[str]:
    """Every registered model with weights here; a tiny config for each family seen only on the hub."""

    root = cache_dir()
    out = [n for n in model_names("package") if is_converted(get_spec(n), root)]
    hub = sorted({get_spec(n).family for n in model_names("hub")})
    return out + [f"tiny-{f}" for f in hub]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvnotes verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"To check the weight files' hashes instead: {WEIGHTS_CHECK} NAME")
    p.add_argument("model", nargs="?", help="a registered model name, or tiny-<family>")
    p.add_argument("--all", action="store_true", help="every registered model (tiny configs for hub-only families)")
    p.add_argument("--dtype", default="auto", help="auto (the model's default), float32, bfloat16, float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--probes", type=int, default=4, help="probe prompts of the splice check")
    p.add_argument("--json", default=None, help="also write the report(s) here as JSON")
    a = p.parse_args(argv)
    if bool(a.model) == a.all:
        p.error(f"give one MODEL or --all (composition go / no-go; the weights' hashes: {WEIGHTS_CHECK} NAME)")
    if a.probes < 1:
        p.error("--probes must be >= 1")
    out = sys.stdout.write
    reports = []
    t0 = time.monotonic()

    def say(line: str) -> None:  # progress on stderr, so stdout keeps the report alone
        sys.stderr.write(f"[{time.monotonic() - t0:6.1f} s] {line}\n")
        sys.stderr.flush()

    for name in _targets() if a.all else [a.model]:
        say(f"{name}: composition go / no-go (RoPE re-rotation, splice fidelity; not the weights' "
            f"hashes, which `{WEIGHTS_CHECK} {name}` checks); loading")
        try:
            rep = verify(_load(name, a.dtype, a.device), n_probes=a.probes, progress=say)
        except (KeyError, ValueError, OSError, WeightsError) as e:  # unknown name, dtype, weights
            sys.stderr.write(f"error: {name}: {e}\n")
            return 2
        reports.append(rep)
        out("\n".join(rep.lines()) + "\n")
    if a.all or len(reports) > 1:
        out("\n" + TABLE_HEAD + "\n" + "\n".join(r.row() for r in reports) + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([r.to_dict() for r in reports], f, indent=1, default=str)
    return 0 if all(r.go for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
