"""kvnotes.measure.score: metrics as sums of teacher-forced terms, checked against HF forwards."""

from __future__ import annotations

import pytest
import torch
from hf_reference import forward

from kvnotes.edit.patching import make_pair, patched_scores
from kvnotes.measure import score
from kvnotes.pairs import Pair


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread."""


def test_ids_diff_is_the_logit_difference_of_two_rows():
    logits = torch.tensor([[0.0, 2.0, -1.0], [1.0, 1.0, 4.0]])
    m = score.ids_diff(1, 2)
    assert m(logits).tolist() == [3.0, -3.0]
    assert m(logits[None]).shape == (1, 2)  # any leading shape
    assert m.next_token and not m.needs_reference


def test_single_token_answers_read_the_logit_difference_and_several_the_whole_log_probability(tiny_llama_vocab):
    tok = tiny_llama_vocab.tokenizer
    one = score.logit_diff(tok, " Alpha", " Beta")
    assert one.next_token and one.terms[0].vocab is not None and len(one.terms[0].vocab) == 2
    many = score.logit_diff(tok, " Alphabetical order", " Beta")
    assert not many.next_token and len(many.terms) == 2
    with pytest.raises(ValueError, match="same tokens"):
        score.logit_diff(tok, " Alpha", " Alpha")


def test_a_teacher_forced_metric_equals_the_log_probability_of_a_plain_forward(tiny_llama_vocab):
    model, tok = tiny_llama_vocab, tiny_llama_vocab.tokenizer
    clean = "The badge is red. If the badge is red, reply Alpha; otherwise Beta. Reply:"
    corrupt = clean.replace("red.", "blue.", 1)
    metric = score.logit_diff(tok, " Alphabetical order", " Beta testing", clean)
    pair = Pair.from_prompts(model, clean, corrupt, metric=metric)
    pp = make_pair(model, pair)

    def by_hand(ids: tuple[int, ...]) -> float:
        total = 0.0
        for term, sign in zip(metric.terms, (1.0, -1.0), strict=True):
            cont = list(term.continuation)
            logits, _ = forward(model, None, list(ids) + cont[:-1], 0)
            lp = torch.log_softmax(logits[len(ids) - 1:], dim=-1)  # rows predicting the continuation
            total += sign * float(sum(lp[j, c] for j, c in enumerate(cont)))
        return total

    assert pp.score_stale == pytest.approx(by_hand(pair.old_ids), abs=1e-4)
    assert pp.score_oracle == pytest.approx(by_hand(pair.new_ids), abs=1e-4)
    s = patched_scores(model, pp, [[], list(range(pp.n_cached))])
    assert s.tolist() == pytest.approx([pp.score_stale, pp.score_oracle], abs=1e-4)


def test_kl_to_clean_is_zero_at_the_clean_run_and_positive_at_the_corrupt(tiny_llama_vocab):
    model = tiny_llama_vocab
    clean = "The door code is 4417. The door opens only for 4417. Open or Locked?"
    pair = Pair.from_prompts(model, clean, clean.replace("4417.", "9023.", 1), metric="kl")
    pp = make_pair(model, pair)
    assert pp.metric.next_token and not pp.metric.needs_reference  # bound to the clean logits
    assert pp.score_oracle == pytest.approx(0.0, abs=1e-5) and pp.score_stale > 1e-6
    with pytest.raises(ValueError, match="needs the clean logits"):
        score.kl_to_clean()(torch.zeros(3))


def test_a_callable_metric_and_what_resolve_refuses(tiny_llama_vocab):
    tok = tiny_llama_vocab.tokenizer
    m = score.resolve(lambda logits: logits[..., 3] - logits[..., 4], tok, None, None)
    assert m(torch.arange(8.0)[None]).tolist() == [-1.0]
    bad = score.from_callable(lambda logits: logits.sum())
    with pytest.raises(ValueError, match=r"\[n\]"):
        bad.terms[0].fn(torch.zeros(2, 1, 8))
    with pytest.raises(ValueError, match="unknown metric 'logitdiff'"):
        score.resolve("logitdiff", tok, [" a", " b"], None)
    with pytest.raises(ValueError, match="takes 2 answer"):
        score.resolve("logit_diff", tok, [" a"], None)
    with pytest.raises(ValueError, match="needs a metric"):
        score.resolve(None, tok, None, None)
