"""Metrics on the logits of a prompt: what a patch, attribution or knockout moves.

A metric is a sum of terms; each term teacher-forces a continuation after the prompt (none: the
next-token logits only) and maps those logits to one number per row. So the logit difference of
two single-token answers is one term on two vocabulary rows, logit[a] - logit[b]; for answers of
several tokens it is the teacher-forced log-probability of the whole first answer minus that of
the second (for single tokens the two readings are equal: the softmax's normaliser cancels). A
user's callable on the next-token logits is one term over the whole vocabulary. KL to the clean
distribution needs the clean run's logits: `bind` fixes them once they are known.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

TermFn = Callable[[Float[Tensor, "n tail vocab"]], Float[Tensor, " n"]]


@dataclass(frozen=True)
class Term:
    """One read of the logits: `fn(logits)` of the rows that predict `continuation` (the
    next-token row when it is empty), restricted to the token ids `vocab` (None: all)."""

    continuation: tuple[int, ...]
    fn: TermFn
    vocab: tuple[int, ...] | None = None

    def tail(self, last: int) -> list[int]:
        """The ids run after the cache: the last prompt token, then the continuation but its last."""
        return [last, *self.continuation[:-1]]

    def select(self, logits: Float[Tensor, "n tail vocab"]) -> Float[Tensor, "n tail k"]:
        """Full-vocabulary logits cut to this term's rows (a no-op without `vocab`)."""
        return logits if self.vocab is None else logits[..., list(self.vocab)]


@dataclass(frozen=True)
class Metric:
    """A named sum of `Term`s; `needs_reference` until `bind` gives it the clean logits."""

    name: str
    terms: tuple[Term, ...] = ()
    binder: Callable[[Float[Tensor, " vocab"]], Metric] | None = None

    @property
    def needs_reference(self) -> bool:
        return self.binder is not None

    @property
    def next_token(self) -> bool:
        """Whether every term reads the next-token logits only (no teacher forcing)."""
        return all(not t.continuation for t in self.terms)

    def bind(self, clean_logits: Float[Tensor, " vocab"]) -> Metric:
        """The metric with its reference (the clean run's next-token logits) fixed."""
        return self if self.binder is None else self.binder(clean_logits.detach().float())

    def read(self, run: Callable[[list[int], tuple[int, ...] | None], Float[Tensor, "n tail vocab"]],
             last: int) -> Float[Tensor, " n"]:
        """The score of many variants, each term read by `run(tail ids, vocab rows or None)`, which
        runs the last prompt token and the term's continuation after every variant ([n, tail, k])."""
        if self.needs_reference:
            raise ValueError(f"metric {self.name!r} needs the clean logits first: metric.bind(clean_logits)")
        out = [t.fn(run(t.tail(last), t.vocab)).double() for t in self.terms]  # summed in float64
        return torch.stack(out).sum(0)

    def __call__(self, logits: Float[Tensor, "*batch vocab"]) -> Float[Tensor, "*batch"]:
        """The score of next-token logits of any leading shape (fp32)."""
        if self.needs_reference:
            raise ValueError(f"metric {self.name!r} needs the clean logits first: metric.bind(clean_logits)")
        if not self.next_token:
            raise ValueError(f"metric {self.name!r} teacher-forces a continuation; it cannot be read from "
                             "next-token logits alone (kvnotes.edit.patching reads it through the engine)")
        flat = logits.reshape(-1, 1, logits.shape[-1]).float()  # [rows, 1, vocab]
        out = sum(t.fn(t.select(flat)) for t in self.terms)
        return torch.as_tensor(out).reshape(logits.shape[:-1])


def _diff(logits: Tensor) -> Tensor:
    return logits[:, -1, 0].float() - logits[:, -1, 1].float()  # [n]


def ids_diff(positive: int, negative: int, name: str | None = None) -> Metric:
    """logit[positive] - logit[negative] of the next token (the task suites' decision score)."""
    return Metric(name or f"logit_diff({positive},{negative})", (Term((), _diff, (positive, negative)),))


def _logprob(ids: tuple[int, ...], sign: float) -> TermFn:
    def fn(logits: Tensor) -> Tensor:  # [n, len(ids), vocab]: row j predicts ids[j]
        lp = torch.log_softmax(logits.float(), dim=-1)
        idx = torch.as_tensor(ids, device=logits.device)[None, :, None].expand(logits.shape[0], -1, 1)
        return sign * lp.gather(-1, idx)[..., 0].sum(-1)
    return fn


def _continuation(tok: Any, prompt: str | None, answer: str) -> tuple[int, ...]:
    """The ids of `answer` as it follows `prompt` (the suffix of the joint encoding when the prompt's
    own ids are its prefix, else the answer encoded alone)."""
    alone = tuple(tok(answer, add_special_tokens=False)["input_ids"])
    if prompt:
        p = list(tok(prompt, add_special_tokens=False)["input_ids"])
        joint = list(tok(prompt + answer, add_special_tokens=False)["input_ids"])
        if joint[: len(p)] == p and len(joint) > len(p):
            return tuple(joint[len(p):])
    if not alone:
        raise ValueError(f"answer {answer!r} encodes to no tokens")
    return alone


def logit_diff(tok: Any, a: str, b: str, prompt: str | None = None) -> Metric:
    """Score of answer `a` over answer `b`: their logit difference when each is one token, else
    the teacher-forced log-probability of the whole of `a` minus that of `b`. `prompt` (the text
    the answers follow) lets the tokenizer merge a leading space as it would in context."""
    ca, cb = _continuation(tok, prompt, a), _continuation(tok, prompt, b)
    if ca == cb:
        raise ValueError(f"answers {a!r} and {b!r} encode to the same tokens")
    name = f"logit_diff({a!r}, {b!r})"
    if len(ca) == 1 and len(cb) == 1:
        return ids_diff(ca[0], cb[0], name)
    return Metric(name, (Term(ca, _logprob(ca, 1.0)), Term(cb, _logprob(cb, -1.0))))


def logprob(tok: Any, target: str, prompt: str | None = None) -> Metric:
    """The teacher-forced log-probability of `target` after the prompt."""
    c = _continuation(tok, prompt, target)
    return Metric(f"logprob({target!r})", (Term(c, _logprob(c, 1.0)),))


def kl_to_clean() -> Metric:
    """KL(clean || patched) of the next-token distribution, in nats (0 at the clean run: the
    recovery of a patch is then 1 - KL / KL(clean || corrupt))."""
    def bind(ref: Tensor) -> Metric:
        ref_lp = torch.log_softmax(ref.float(), dim=-1)

        def fn(logits: Tensor) -> Tensor:
            lp = torch.log_softmax(logits[:, -1].float(), dim=-1)  # [n, vocab]
            r = ref_lp.to(lp.device)
            return (r.exp() * (r - lp)).sum(-1)
        return Metric("kl_to_clean", (Term((), fn),))
    return Metric("kl_to_clean", (), bind)


def from_callable(fn: Callable[[Tensor], Tensor], name: str | None = None) -> Metric:
    """A user's metric on next-token logits ([*, vocab] -> [*]), e.g.
    `lambda logits: logits[..., ALPHA] - logits[..., BETA]`."""
    def term(logits: Tensor) -> Tensor:
        out = fn(logits[:, -1].float())
        if out.shape != logits.shape[:1]:
            raise ValueError(f"a metric maps logits [n, vocab] to [n]; got shape {tuple(out.shape)}")
        return out.float()
    return Metric(name or str(getattr(fn, "__name__", "metric")), (Term((), term),))


BUILTIN = ("logit_diff", "logprob", "kl")


def resolve(metric: Metric | Callable[[Tensor], Tensor] | str | None, tok: Any,
            answers: Sequence[str] | None, prompt: str | None) -> Metric:
    """A Metric from what a user gives: a Metric, a callable on next-token logits, a built-in's
    name (`logit_diff` and `logprob` read `answers`), or None with two answers (logit_diff)."""
    if isinstance(metric, Metric):
        return metric
    if callable(metric):
        return from_callable(metric)
    name = metric or ("logit_diff" if answers else None)
    if name is None:
        raise ValueError("a pair needs a metric: answers=(a, b) for their logit difference, a built-in "
                         f"name ({', '.join(BUILTIN)}), or a callable on the next-token logits")
    if name not in BUILTIN:
        raise ValueError(f"unknown metric {name!r}; built-ins: {', '.join(BUILTIN)}, or pass a callable")
    if name == "kl":
        return kl_to_clean()
    if tok is None:
        raise ValueError(f"metric {name!r} tokenizes the answers: give the model's tokenizer")
    want = 2 if name == "logit_diff" else 1
    if not answers or len(answers) != want:
        raise ValueError(f"metric {name!r} takes {want} answer(s), got {list(answers or [])}")
    return logit_diff(tok, answers[0], answers[1], prompt) if name == "logit_diff" else logprob(tok, answers[0], prompt)
