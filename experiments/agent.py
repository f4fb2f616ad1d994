"""Experiment `agent`: the unified edit + compose agent against a full recompute, turn by turn.

A scenario (kvnotes.tasks.agents) is a system prompt with several skill blocks and a state
block, then turns whose requests are decided by one skill under the current state; between
turns a state field may change. The composed agent precompiles every skill block alone into the
store, builds its first context by transplanting them after the system head (seam repair K),
and thereafter only appends: each turn adds the previous answer, the state changes as errata
lines (`[STATE UPDATE] ...`, so the prefix stays byte-identical) and the new request. The
reference re-renders the prompt with the state rewritten in place and prefills it from scratch
every turn. Per turn: decision agreement with that reference (and with a full prefill of the
very same erratum prompt, which isolates the transplant), accuracy, and the latency ratio.

    python -m experiments.run +experiment=agent model=llama device=cpu experiment.threads=1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from experiments.shared.compare import compare
from experiments.shared.gate import GateConfig, gate_summary, run_gate
from kvnotes.compose import splice as compose
from kvnotes.compose.store import block_path, load_block, save_block
from kvnotes.engine import run as engine
from kvnotes.errors import ConfigError
from kvnotes.measure.metrics import ci_dict, prop_dict
from kvnotes.measure.timing import timed, torch_threads
from kvnotes.tasks.agents import build_scenarios, render

if TYPE_CHECKING:
    from experiments.shared.context import Context
    from kvnotes.engine.cache import KVCache
    from kvnotes.models import LoadedModel
    from kvnotes.tasks.agents import AgentScenario


@dataclass
class AgentConfig:
    """Scenarios (kvnotes.tasks.agents.build_scenarios) and the transplant's seam repair."""

    n_scenarios: int = 8
    n_skills: int = 3
    n_turns: int = 4
    block_length: int = 200  # filler tokens per skill block
    seam: int = 4
    threads: int | None = None  # torch CPU threads while timing (None: unchanged)
    store_dir: str | None = None  # None: <run dir>/store
    gate: GateConfig = field(default_factory=GateConfig)
    n_boot: int = 1000

    def __post_init__(self) -> None:
        if min(self.n_scenarios, self.n_skills, self.n_turns, self.block_length) < 1:
            raise ConfigError("n_scenarios, n_skills, n_turns and block_length must be >= 1")
        if self.seam < 0:
            raise ConfigError(f"seam must be >= 0, got {self.seam}")


def common_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def precompile(model: LoadedModel, sc: AgentScenario, store: Path) -> dict[str, Path]:
    """Each skill block of the scenario prefilled alone and saved; name -> file."""

    p = render(sc, model.tokenizer, 0, "erratum")
    out = {}
    for name in sc.domains:
        s, e = p.segments[f"skill:{name}"]
        blk = compose.prefill_block(model, list(p.ids[s:e]))
        out[name] = save_block(block_path(store, f"{sc.scenario_id}-{name}"), model, blk, name)
    return out


def scenario(model: LoadedModel, sc: AgentScenario, cfg: AgentConfig, store: Path) -> list[dict[str, Any]]:
    """One record per turn: composed incremental agent vs full recompute (in place / erratum)."""

    tok = model.tokenizer
    files = precompile(model, sc, store)
    rows: list[dict[str, Any]] = []
    cache: KVCache | None = None
    prev: tuple[int, ...] = ()
    for t in range(len(sc.turns)):
        p = render(sc, tok, t, "erratum")
        with timed(model.device) as clock:  # device-synchronised at both ends
            if cache is None:  # first turn: system head, transplanted skills, then the rest
                first = min(p.segments[f"skill:{n}"][0] for n in sc.domains)
                last = max(p.segments[f"skill:{n}"][1] for n in sc.domains)
                head = engine.prefill(model, list(p.ids[:first])).cache
                blocks = [load_block(files[n], model) for n in sc.domains]
                ctx_cache = compose.transplant(model, head, blocks, cfg.seam)
                step = engine.extend(model, ctx_cache, list(p.ids[last:]))
                new_tokens = first + sum(min(cfg.seam, len(b)) for b in blocks) + len(p.ids) - last
            else:  # later turns: keep the cache, append what changed (answer, errata, request)
                keep = common_prefix(prev, p.ids)
                step = engine.extend(model, cache.slice(0, keep), list(p.ids[keep:]))
                new_tokens = len(p.ids) - keep
        composed_s = clock.seconds
        cache, prev = step.cache, p.ids
        logits = step.logits[0, -1]
        ref_p = render(sc, tok, t, "inplace")
        with timed(model.device) as clock:
            ref = engine.prefill(model, list(ref_p.ids)).logits[0, -1]
        full_s = clock.seconds
        same = engine.prefill(model, list(p.ids)).logits[0, -1]  # full recompute, erratum prompt
        vs_ref = compare(logits, ref, p.decision_ids)
        vs_same = compare(logits, same, p.decision_ids)
        correct = p.decision_ids[p.outcomes.index(p.correct)]
        rows.append({
            "kind": "turn", "scenario": sc.scenario_id, "turn": t, "domain": sc.turns[t].domain,
            "n_updates": len(sc.turns[t].updates), "n_tokens": len(p.ids),
            "n_tokens_inplace": len(ref_p.ids), "new_tokens": new_tokens,
            "decision": vs_ref["decision"], "decision_full": vs_ref["decision_ref"],
            "decision_full_erratum": vs_same["decision_ref"],
            "agree": vs_ref["decision_agree"], "agree_erratum": vs_same["decision_agree"],
            "cosine_erratum": vs_same["cosine"], "kl_erratum": vs_same["kl"],
            "cosine_inplace": vs_ref["cosine"],
            "correct": vs_ref["decision"] == correct, "correct_full": vs_ref["decision_ref"] == correct,
            "correct_full_erratum": vs_same["decision_ref"] == correct,
            "composed_s": composed_s, "full_s": full_s, "latency_ratio": full_s / composed_s,
        })
    return rows


def summarize(records: list[dict[str, Any]], cfg: AgentConfig) -> dict[str, Any]:
    """Agreement with full recompute, accuracy and latency ratio, overall and per turn."""
    df = pd.DataFrame(records)
    out: dict[str, Any] = {"gate": gate_summary(df, cfg.gate), "seam": cfg.seam}
    t = df[df["kind"] == "turn"] if "kind" in df.columns else df.iloc[:0]
    if not len(t):
        return out

    def stats(g: pd.DataFrame) -> dict[str, Any]:
        return {
            "agreement": prop_dict(g["agree"].astype(float)),
            "agreement_erratum_prompt": prop_dict(g["agree_erratum"].astype(float)),
            "accuracy": prop_dict(g["correct"].astype(float)),
            "accuracy_full": prop_dict(g["correct_full"].astype(float)),
            "accuracy_full_erratum": prop_dict(g["correct_full_erratum"].astype(float)),
            "cosine_erratum_prompt": ci_dict(g["cosine_erratum"], cfg.n_boot),
            "latency_ratio": ci_dict(g["latency_ratio"], cfg.n_boot),
            "composed_s": float(g["composed_s"].median()), "full_s": float(g["full_s"].median()),
        }

    out["n_scenarios"] = int(t["scenario"].nunique())
    out["overall"] = stats(t)
    out["turns"] = {str(int(k)): stats(g) for k, g in t.groupby("turn")}
    out["later_turns"] = stats(t[t["turn"] > 0])
    return out


def run(ctx: Context) -> None:

    cfg: AgentConfig = ctx.params
    store = Path(cfg.store_dir) if cfg.store_dir else ctx.run_dir / "store"
    chat = ctx.chat
    scs = build_scenarios(ctx.model.tokenizer, chat=chat, n=cfg.n_scenarios, seed=ctx.cfg.seed,
                          n_skills=cfg.n_skills, n_turns=cfg.n_turns, block_length=cfg.block_length)
    units = {f"scenario-{sc.scenario_id}": sc for sc in scs}
    with torch_threads(cfg.threads):
        run_gate(ctx, cfg.gate)
        for key in ctx.pending(list(units), desc="agent scenarios"):
            ctx.write(key, scenario(ctx.model, units[key], cfg, store))


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "agent"
CONFIG = AgentConfig
HELP = "multi-turn agent with transplanted skills and errata vs full recompute per turn"
