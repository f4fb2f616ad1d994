"""A file of prompt pairs: one JSON object a line, the prompts used verbatim.

    {"id": "badge-01", "cluster": "badge", "clean": "...", "corrupt": "...", "answers": [" Alpha", " Beta"]}

`clean` / `corrupt`: a string (tokenized as written), a list of chat messages (the model's chat
template with its generation prompt) or a list of token ids. `answers`: the clean prompt's answer,
then the corrupt one's; `metric` (optional): `logit_diff` (default), `logprob` (of the first
answer) or `kl` (to the clean distribution). Optional: `field` (a substring or [start, end)
character span of the clean prompt; default where the prompts differ), `spans` (name -> substring
or span), `cluster` (pairs that share a template or conversation: the cluster interval's unit).
The whole file is checked (types, sizes, unknown keys, duplicate ids) before any model loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvnotes.errors import ConfigError
from kvnotes.measure.score import logit_diff
from kvnotes.pairs.pair import Pair, PairError
from kvnotes.tasks.item import TaskItem

MAX_BYTES = 64 * 2**20  # a prompts file larger than this is refused before it is read
MAX_PROMPT = 400_000  # characters (or ids) per prompt
MAX_LINES = 100_000
KEYS = {"id", "cluster", "clean", "corrupt", "answers", "metric", "field", "spans"}
METRICS = ("logit_diff", "logprob", "kl")


def _prompt_ok(v: Any) -> bool:
    if isinstance(v, str):
        return 0 < len(v) <= MAX_PROMPT
    if isinstance(v, list) and v and len(v) <= MAX_PROMPT:
        if all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v):
            return True
        return all(isinstance(m, dict) and set(m) == {"role", "content"} and isinstance(m["role"], str)
                   and isinstance(m["content"], str) for m in v) and sum(len(m["content"]) for m in v) <= MAX_PROMPT
    return False


def _where_ok(v: Any) -> bool:
    return (isinstance(v, str) and bool(v)) or (isinstance(v, list) and len(v) == 2
                                                and all(isinstance(i, int) and not isinstance(i, bool) for i in v))


def check_line(obj: Any, where: str) -> dict[str, Any]:
    """One line's object, checked; raises ConfigError naming the line and what is valid."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: a line must be a JSON object, got {type(obj).__name__}")
    extra = set(obj) - KEYS
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {sorted(extra)}; valid: {', '.join(sorted(KEYS))}")
    for k in ("clean", "corrupt", "answers"):
        if k not in obj:
            raise ConfigError(f"{where}: {k!r} is required")
    for k in ("clean", "corrupt"):
        if not _prompt_ok(obj[k]):
            raise ConfigError(f"{where}: {k!r} must be a non-empty string, a list of {{role, content}} messages or a "
                              f"list of token ids (at most {MAX_PROMPT} characters)")
    if type(obj["clean"]) is not type(obj["corrupt"]):
        raise ConfigError(f"{where}: 'clean' and 'corrupt' must be given the same way (both strings, messages or ids)")
    ans = obj["answers"]
    if not (isinstance(ans, list) and len(ans) == 2 and all(isinstance(a, str) and 0 < len(a) <= 200 for a in ans)):
        raise ConfigError(f"{where}: 'answers' must be two strings [clean's answer, corrupt's answer]")
    if ans[0].strip() == ans[1].strip():
        raise ConfigError(f"{where}: the two answers are the same word {ans[0]!r}")
    if obj.get("metric", "logit_diff") not in METRICS:
        raise ConfigError(f"{where}: metric {obj['metric']!r}; valid: {', '.join(METRICS)}")
    if "field" in obj and not _where_ok(obj["field"]):
        raise ConfigError(f"{where}: 'field' must be a substring of the clean prompt or a [start, end] span")
    spans = obj.get("spans", {})
    if not (isinstance(spans, dict) and all(isinstance(k, str) and k and _where_ok(v) for k, v in spans.items())):
        raise ConfigError(f"{where}: 'spans' must map names to substrings or [start, end] spans")
    for k in ("id", "cluster"):
        if k in obj and not (isinstance(obj[k], str) and 0 < len(obj[k]) <= 200):
            raise ConfigError(f"{where}: {k!r} must be a non-empty string")
    return obj


def read_pairs_file(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every line of a prompts file, checked, with its id (`line-N` when absent); no tokenizer needed."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"prompts file {str(path)!r} does not exist (one JSON object a line: clean, corrupt, answers)")
    if p.stat().st_size > MAX_BYTES:
        raise ConfigError(f"prompts file {str(path)!r} is {p.stat().st_size} bytes; at most {MAX_BYTES} are read")
    out, seen = [], set()
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if n > MAX_LINES:
                raise ConfigError(f"{path}: more than {MAX_LINES} lines")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno})") from None
            obj = check_line(obj, f"{path}:{n}")
            obj = {**obj, "id": obj.get("id", f"line-{n}"), "_line": n}
            if obj["id"] in seen:
                raise ConfigError(f"{path}:{n}: id {obj['id']!r} appears twice")
            seen.add(obj["id"])
            out.append(obj)
    if not out:
        raise ConfigError(f"prompts file {str(path)!r} holds no pairs")
    return out


def _where(v: Any) -> str | tuple[int, int]:
    return v if isinstance(v, str) else (int(v[0]), int(v[1]))


def pair_of(tok: Any, obj: Mapping[str, Any]) -> Pair:
    """The Pair of one checked line."""
    field = obj.get("field")
    return Pair.from_prompts(tok, obj["clean"], obj["corrupt"], answers=obj["answers"] if obj.get("metric") != "kl" else None,
                             metric=obj.get("metric", "logit_diff") if obj.get("metric") != "kl" else "kl",
                             field=None if field is None else _where(field),
                             spans={k: _where(v) for k, v in obj.get("spans", {}).items()},
                             pair_id=str(obj["id"]), cluster=obj.get("cluster"))


def as_item(tok: Any, obj: Mapping[str, Any], path: str = "") -> TaskItem:
    """A line as the harness's TaskItem (suite `pairs`, domain = cluster): its metric is the pair's,
    its outcomes the two answers (the probes' decisions compare their first tokens)."""
    pair = pair_of(tok, obj)
    a, b = (str(x) for x in obj["answers"])
    terms = pair.metric.terms if pair.metric.name.startswith("logit_diff") else logit_diff(tok, a, b, pair.new_text).terms
    ids = (terms[0].vocab or (terms[0].continuation[0], terms[1].continuation[0]))[:2]  # the answers' first tokens
    if ids[0] == ids[1]:
        raise PairError(f"{obj['id']}: answers {a!r} and {b!r} start with the same token; the probes' decisions "
                        "compare first tokens: choose answers whose first tokens differ")
    s, e = pair.field_span
    cluster = str(obj.get("cluster") or obj["id"])
    return TaskItem(
        item_id=str(obj["id"]), suite="pairs", domain=cluster, template_id=cluster, seed=0, variant="field",
        field_name="field", old_value=tok.decode(list(pair.old_ids[s:e])), new_value=tok.decode(list(pair.new_ids[s:e])),
        old_text=pair.old_text or "", new_text=pair.new_text or "", old_ids=pair.old_ids, new_ids=pair.new_ids,
        field_span=pair.field_span, aggregators=pair.aggregators, outcomes=(a.strip(), b.strip()),
        decision_ids=(int(ids[0]), int(ids[1])), correct_old=b.strip(), correct_new=a.strip(),
        chat=isinstance(obj["clean"], list) and isinstance(obj["clean"][0], dict), segments=dict(pair.segments),
        meta={"path": path, "line": obj.get("_line"), "metric": pair.metric.name}, score_metric=pair.metric,
    )


def load_pairs(path: str | os.PathLike[str], tokenizer: Any, n: int | None = None) -> list[TaskItem]:
    """The first `n` (None: all) pairs of a prompts file as TaskItems for `tokenizer`."""
    lines = read_pairs_file(path)
    return [as_item(tokenizer, obj, str(path)) for obj in lines[: n or None]]


def pairs_file(path: str | os.PathLike[str], model_or_tokenizer: Any) -> list[Pair]:
    """Every pair of a prompts file as `Pair`s."""
    tok = getattr(model_or_tokenizer, "tokenizer", model_or_tokenizer)
    return [pair_of(tok, obj) for obj in read_pairs_file(path)]

