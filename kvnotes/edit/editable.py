"""`EditableCache`: amend the KV cache of your own prompt when a value in it changes.

Prefill a prompt once; when a value changes (an account role, an order status), pick how to
bring the cache up to date: `erratum` appends an update line (the prefix and its cache stay
byte-identical, as a serving prefix cache wants), `field_only` rewrites the value's own K/V
(cheap, and mostly ignored by the model: its conclusions live in later note tokens),
`selective_recompute_att` (or `selective`) also recomputes the K most-attended note positions, `full_downstream` recomputes
everything from the value on, `oracle` re-prefills. `transplant` splices precompiled blocks (from
`kvnotes.compose.splice` or the store) into the prompt, each rotated to where it lands, its first `seam`
tokens recomputed (seam = block length is exact). The result works with `model.generate` and,
through `cache.to_dynamic()`, with nnsight; its cache holds every token but the last, which the
trace runs (docs/conventions.md):

    r = EditableCache(model, prompt).edit("account_role: admin", "account_role: guest")
    with model.nnsight.trace(torch.tensor([r.ids[-1:]]), past_key_values=r.cache.to_dynamic()):
        logits = model.nnsight.output.logits.save()

`logits` equals `model.hf` on that cache bit for bit (the same modules, the same kernel), and
`r.next_token_logits()` within fp32 rounding, not bit for bit: kvnotes runs its own attention
path (kvnotes.engine.causal), which sums in another order (2.1e-5 at most on llama in fp32,
over three strategies; tests/engine/test_nnsight.py holds it to 5e-5).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvnotes.compose.splice import Block, seam_tokens, transplant
from kvnotes.compose.store import load_block
from kvnotes.edit import registry
from kvnotes.edit.strategies import ERRATA
from kvnotes.engine.cache import KVCache
from kvnotes.engine.generation import GenerateOutput, generate
from kvnotes.engine.run import extend, prefill, recompute
from kvnotes.engine.variants import read_variants
from kvnotes.errors import ConfigError, KvnotesError
from kvnotes.models.loading import LoadedModel

BlockLike = Block | str | os.PathLike[str]  # a block, or the path of a stored one


class EditError(KvnotesError, ValueError):
    """An edit that cannot be made as asked; the message says what would work."""


@dataclass(frozen=True)
class EditResult:
    """An edited prompt: its token ids and the cache of all but the last token."""

    model: LoadedModel
    ids: tuple[int, ...]
    cache: KVCache  # positions 0 .. len(ids) - 2
    strategy: str
    recomputed: int

    @property
    def text(self) -> str:
        return str(self.model.tokenizer.decode(list(self.ids)))

    def next_token_logits(self) -> torch.Tensor:
        """Logits [vocab] (fp32) of the token after the prompt: the last id run on the cache."""
        return extend(self.model, self.cache, list(self.ids[-1:])).logits[0, -1]

    def edit(self, old: str, new: str, strategy: str = "erratum", **kwargs: Any) -> EditResult:
        """Edit this edited prompt again, from its cache (`EditableCache.edit`'s arguments): a chain
        of edits and transplants never starts over."""
        return EditableCache.from_result(self).edit(old, new, strategy, **kwargs)

    def transplant(self, blocks: BlockLike | Sequence[BlockLike], seam: int = 0,
                   insert_before: str | None = None) -> EditResult:
        """Splice precompiled blocks into this edited prompt, from its cache
        (`EditableCache.transplant`'s arguments)."""
        return EditableCache.from_result(self).transplant(blocks, seam, insert_before)

    def generate(self, max_new_tokens: int | None = None, **kwargs: Any) -> GenerateOutput:
        """Continuation from the edited cache (`model.generate` on a DynamicCache copy of it).

        Greedy unless `kwargs` say otherwise: they pass through to `generate` (`do_sample=True`,
        `temperature`, `top_p`, `num_return_sequences`, `num_beams`, `output_scores=True`,
        `stop_strings`, a `generation_config`, ...). `max_new_tokens` new tokens, or `max_length`
        in all, prompt included, as in Hugging Face (neither: 16 new tokens). Returns a
        `GenerateOutput`: `.text` (also `str(out)`), `.texts`, `.ids` (the new tokens, [n, new]),
        `.sequences`, and `.scores` when asked.
        """
        gen = {"do_sample": False, **kwargs}
        return generate(self.model, self.cache, list(self.ids), max_new_tokens, **gen)


Messages = Sequence[dict[str, str]]  # chat messages: [{"role": "user", "content": "..."}, ...]


def chat_text(model: LoadedModel, messages: Messages) -> str:
    """The prompt text of chat `messages` by the model's chat template, generation prompt added."""
    if not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
        raise EditError("a chat prompt is a list of {'role': ..., 'content': ...} dicts")
    if not getattr(model.tokenizer, "chat_template", None):
        raise EditError(f"model {model.name!r} has no chat template, so chat messages cannot be "
                        f"turned into a prompt; pass the prompt as text")
    return str(model.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                   add_generation_prompt=True))


class EditableCache:
    """The cache of one prompt: text (tokenized as it is: no special tokens added, so a chat
    template's own markers are the only ones), or chat messages (a list of {"role", "content"}
    dicts, rendered by the model's chat template with the generation prompt). See
    docs/conventions.md for what the cache holds (every token but the last)."""

    def __init__(self, model: LoadedModel, prompt: str | Messages) -> None:
        if model.tokenizer is None:
            raise EditError("EditableCache needs a model with a tokenizer")
        if isinstance(prompt, dict) or not isinstance(prompt, str | Sequence):
            raise EditError(f"the prompt is text or a list of chat messages, not {type(prompt).__name__}")
        text = prompt if isinstance(prompt, str) else chat_text(model, prompt)
        self.model, self.prompt = model, text
        self.ids = self._encode(text)
        if len(self.ids) < 2:
            raise EditError("the prompt must be at least two tokens long (the cache holds all but "
                            "the last: docs/conventions.md)")
        self.cache = prefill(model, self.ids[:-1]).cache
        self._resynced = 0  # tokens recomputed to bring a resumed cache in line (from_result)

    @classmethod
    def from_result(cls, result: EditResult) -> EditableCache:
        """An EditableCache of an edited prompt (its text), over the result's cache: no prefill.

        Edits find text in the prompt, so its ids must be what the text tokenizes to; where a
        splice seam tokenizes otherwise (a BPE merge across it), the cache is kept up to the first
        differing token and the rest recomputed once (counted in the next result's `recomputed`).
        """
        self = cls.__new__(cls)
        self.model, self.prompt, self.cache = result.model, result.text, result.cache
        self.ids, self._resynced = self._encode(self.prompt), 0
        if self.ids != result.ids:
            c = next((i for i, (a, b) in enumerate(zip(self.ids, result.ids)) if a != b),
                     min(len(self.ids), len(result.ids)))
            c = min(c, self.cache.seq_len, len(self.ids) - 1)
            rest = list(self.ids[c:-1])
            self.cache = self.cache.slice(0, c)
            if rest:
                self.cache = extend(self.model, self.cache, rest).cache
            self._resynced = len(self.ids) - 1 - c
        return self

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.model.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _locate(self, old: str) -> int:
        n = self.prompt.count(old)
        if n == 0:
            raise EditError(f"{old!r} is not in the prompt{_near(self.prompt, old)}; check the text "
                            f"(case, spaces and line breaks count)")
        if n > 1:
            raise EditError(f"{old!r} occurs {n} times in the prompt; give a longer, unique text "
                            f"(e.g. 'account_role: admin')")
        return self.prompt.index(old)

    def _boundary(self, char: int) -> int:
        """Index of the first prompt token that starts at or after character `char`."""
        enc = self.model.tokenizer(self.prompt, add_special_tokens=False, return_offsets_mapping=True)
        starts = [s for s, _ in enc["offset_mapping"]]
        return next((i for i, s in enumerate(starts) if s >= char), len(self.ids))

    def edit(self, old: str, new: str, strategy: str = "erratum", field: str | None = None,
             k: int = 8, wording: str | None = None, insert_before: str | None = None,
             erratum: str | None = None) -> EditResult:
        """The prompt with `old` (a unique text in it) now reading `new`, by `strategy`.

        The erratum is a named `wording` (kvnotes.edit.strategies.ERRATA, default 'explicit')
        filled with `field` (default: the text before `old` on its line, e.g. 'account_role') and
        `new`, or your own sentence `erratum` ("Erratum: the badge is blue."), inserted as written
        on a line of its own; `insert_before` places it before that text (default: the end).
        """
        try:  # the strategies offered on a prompt: kvnotes.edit.registry, on_prompt=True
            strategy = registry.get(strategy, on_prompt=True).name
        except ConfigError as e:
            raise EditError(str(e)) from None
        if erratum is not None:
            _check_own_erratum(erratum, strategy, field, wording)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise EditError(f"k (note positions recomputed by 'selective') must be an int >= 0, got {k!r}")
        at = self._locate(old)
        if len(self._encode(self.prompt[:at] + new + self.prompt[at + len(old):])) < 2:
            raise EditError(f"replacing {old[:40]!r} by {new[:40]!r} leaves fewer than two tokens of prompt; "
                            "an edit keeps a prompt to read the decision from")
        if strategy == "erratum":
            text = erratum if erratum is not None else self._wording(at, old, new, field, wording)
            return self._erratum(at, old, text, insert_before)
        new_ids = self._encode(self.prompt[:at] + new + self.prompt[at + len(old):])
        c = next((i for i, (a, b) in enumerate(zip(self.ids, new_ids)) if a != b), min(len(self.ids), len(new_ids)))
        if strategy == "oracle":
            return EditResult(self.model, new_ids, prefill(self.model, new_ids[:-1]).cache, strategy, len(new_ids))
        if strategy == "full_downstream":
            cache = extend(self.model, self.cache.slice(0, c), new_ids[c:-1]).cache
            return EditResult(self.model, new_ids, cache, strategy, len(new_ids) - c + self._resynced)
        if len(new_ids) != len(self.ids):
            raise EditError(f"{old!r} and {new!r} tokenize to different lengths here, so the cache "
                            f"cannot be edited in place; use strategy 'erratum' or 'full_downstream'")
        span = [i for i, (a, b) in enumerate(zip(self.ids, new_ids)) if a != b]
        if not span or span[-1] >= len(self.ids) - 1:
            raise EditError("the value must change and lie before the last token")
        chosen = span if strategy == "field_only" else span + self._notes(span[-1] + 1)[:k]
        cache = recompute(self.model, self.cache, new_ids[:-1], chosen)
        return EditResult(self.model, new_ids, cache, strategy, len(set(chosen)) + self._resynced)

    def _notes(self, start: int) -> list[int]:
        """Positions after `start` by the last token's attention (mean over layers and heads)."""
        cap: list[dict[int, torch.Tensor]] = []
        read_variants(self.model, self.cache, self.cache, [[]], list(self.ids[-1:]), capture=cap)
        w = torch.stack([cap[0][i][0, :, -1, : self.cache.seq_len] for i in sorted(cap[0])]).mean((0, 1))
        down = list(range(start, self.cache.seq_len))
        return [down[i] for i in torch.argsort(w[down], descending=True).tolist()]

    def _wording(self, at: int, old: str, new: str, field: str | None, wording: str | None) -> str:
        """The named erratum `wording` (default 'explicit') saying `field` is now `new`."""
        wording = "explicit" if wording is None else wording
        if field is None and ":" in old:  # "account_role: admin" -> account_role
            field = old.split(":", 1)[0].strip()
        if field is None:
            line_start = self.prompt.rfind("\n", 0, at) + 1
            field = self.prompt[line_start:at].strip().rstrip(":=").strip() or "the value"
        if ":" in new and new.split(":", 1)[0].strip() == field:
            new = new.split(":", 1)[1].strip()
        if wording not in ERRATA:
            raise EditError(f"unknown wording {wording!r}; valid: {', '.join(ERRATA)}, or your own "
                            f"sentence as erratum='...'")
        return ERRATA[wording].format(field=field, value=new)

    def _erratum(self, at: int, old: str, sentence: str, insert_before: str | None) -> EditResult:
        """The prompt with the line `sentence` inserted before `insert_before` (default: the end)."""
        text = sentence + "\n"
        if insert_before is None:
            b, text = len(self.ids), "\n" + text
        else:
            if insert_before not in self.prompt[at:]:
                raise EditError(f"insert_before {insert_before!r} does not occur after {old!r}")
            b = self._boundary(self.prompt.index(insert_before, at))
        err = self._encode(text)
        ids = self.ids[:b] + err + self.ids[b:]
        cache = extend(self.model, self.cache.slice(0, min(b, self.cache.seq_len)),
                       list(ids[min(b, self.cache.seq_len):-1])).cache
        done = len(ids) - 1 - min(b, self.cache.seq_len)
        return EditResult(self.model, ids, cache, "erratum", done + self._resynced)


    def transplant(self, blocks: BlockLike | Sequence[BlockLike], seam: int = 0,
                   insert_before: str | None = None) -> EditResult:
        """The prompt with precompiled blocks spliced in before `insert_before` (default: the end).

        Blocks (or paths of stored ones, checked by `kvnotes.compose.store.load_block`) are placed in
        order by `kvnotes.compose.splice.transplant`: keys rotated to where they land, the first `seam`
        tokens of each recomputed against everything before them (seam >= a block's length:
        exact). The prompt's cache is kept up to the insertion point and its remaining tokens are
        recomputed after the blocks.
        """

        items = [blocks] if isinstance(blocks, Block | str | os.PathLike) else list(blocks)
        if not items:
            raise EditError("nothing to transplant: give a Block, a stored block's path, or a list")
        blks = [b if isinstance(b, Block) else load_block(b, self.model) for b in items]
        if any(b.cache.n_layers != self.model.n_layers for b in blks):
            raise EditError("a block was prefilled by a model with another number of layers")
        b = len(self.ids)
        if insert_before is not None:
            if (n := self.prompt.count(insert_before)) == 0:
                raise EditError(f"insert_before {insert_before!r} is not in the prompt"
                                f"{_near(self.prompt, insert_before)}; check the text")
            if n > 1:
                raise EditError(f"insert_before {insert_before!r} occurs {n} times in the prompt; "
                                f"give a longer, unique text")
            b = self._boundary(self.prompt.index(insert_before))
            if b == 0:
                raise EditError("blocks go after at least one prompt token")
        if b <= self.cache.seq_len:
            head = self.cache.slice(0, b)
        else:  # the prompt's last token has no K/V yet
            head = extend(self.model, self.cache, list(self.ids[self.cache.seq_len:b])).cache
        new = tuple(int(t) for blk in blks for t in blk.ids[0].tolist())
        ids = self.ids[:b] + new + self.ids[b:]
        cache = transplant(self.model, head, blks, seam)  # prompt[:b] + blocks
        cache = cache.slice(0, min(cache.seq_len, len(ids) - 1))
        rest = list(ids[cache.seq_len:-1])
        if rest:
            cache = extend(self.model, cache, rest).cache
        recomputed = sum(seam_tokens(seam, len(blk)) for blk in blks) + len(rest)
        return EditResult(self.model, ids, cache, "transplant", recomputed + self._resynced)


def _check_own_erratum(erratum: str, strategy: str, field: str | None, wording: str | None) -> None:
    """EditError unless `erratum` is text for the erratum strategy, given without field/wording."""
    if strategy != "erratum":
        raise EditError(f"erratum= is the sentence strategy 'erratum' inserts; strategy "
                        f"{strategy!r} rewrites the value instead: drop erratum= or use 'erratum'")
    if not isinstance(erratum, str) or not erratum.strip():
        raise EditError(f"erratum is the sentence to insert (text), got {erratum!r}")
    if field is not None or wording is not None:
        raise EditError("erratum= is the whole sentence, used as written: drop field= and wording=")


def _near(prompt: str, old: str, width: int = 60) -> str:
    """Where `old` nearly occurs (ignoring case and spacing), else how the prompt begins."""
    squash = " ".join(old.split()).lower()
    flat = " ".join(prompt.split())
    at = flat.lower().find(squash) if squash else -1
    if at >= 0:
        return f" (but {flat[at : at + len(squash)]!r} is, differing in case or spacing)"
    head = prompt[:width] + ("..." if len(prompt) > width else "")
    return f" (which begins {head!r})"


def demo_prompt() -> str:
    """A small gated prompt for examples and tests."""
    return os.linesep.join([
        "Session:", "account_role: admin", "",
        "Policy: when account_role is admin, call grant_access; when it is guest, call escalate.",
        "Tools: grant_access, escalate", "",
        "Request: let me into the audit dashboard.",
        "Next action:",
    ])
