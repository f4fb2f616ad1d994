"""Skills, user memory and agent scenarios: portable blocks, correct answers, state changes."""

from __future__ import annotations

from kvnotes.tasks import build_suite
from kvnotes.tasks.agents import build_scenarios, render
from kvnotes.tasks.memory import fact_names
from kvnotes.tasks.skills import skill_names
from kvnotes.tasks.tokens import encode


def test_at_least_eight_skills_and_blocks_are_position_portable(named_tok):
    _, tok, chat = named_tok
    assert len(skill_names()) >= 8
    items = build_suite("skills", tok, chat=chat, n_items=len(skill_names()), length=600)
    assert {it.domain for it in items} == set(skill_names())
    for it in items:
        blocks = {k: v for k, v in it.segments.items() if k.startswith("skill:")}
        assert len(blocks) == 3 and f"skill:{it.domain}" in blocks
        s, e = blocks[f"skill:{it.domain}"]
        text = tok.decode(it.old_ids[s:e])
        assert "Rule:" in text and it.outcomes[0] in text and it.outcomes[1] in text
        # the field (in the question) comes after every block
        assert all(e2 <= it.field_span[0] for _, e2 in blocks.values())


def test_memory_field_sits_in_the_memory_block_after_the_log(named_tok):
    _, tok, chat = named_tok
    items = build_suite("memory", tok, chat=chat, n_items=len(fact_names()), length=600)
    assert len(fact_names()) >= 8
    for it in items:
        ms, me = it.segments["memory"]
        ts, te = it.segments["trajectory"]
        assert te <= ms <= it.field_span[0] < it.field_span[1] <= me
        assert it.correct_old != it.correct_new


def test_agent_scenarios_follow_the_state(named_tok):
    _, tok, chat = named_tok
    scs = build_scenarios(tok, chat, n=6, seed=0, n_skills=3, n_turns=4, block_length=120)
    assert scs == build_scenarios(tok, chat, n=6, seed=0, n_skills=3, n_turns=4, block_length=120)
    n_updates = 0
    for sc in scs:
        assert len(sc.domains) == 3 and len(sc.turns) == 4
        for t, turn in enumerate(sc.turns):
            n_updates += len(turn.updates)
            from kvnotes.tasks.domains import builtin_domains

            d = builtin_domains()[turn.domain]
            value = sc.state_at(t)[d.field]
            assert turn.correct == d.outcomes[d.values.index(value)]
            er = render(sc, tok, t, "erratum")
            ip = render(sc, tok, t, "inplace")
            assert er.correct == ip.correct == turn.correct
            assert len(set(er.decision_ids)) == 2
            # erratum mode keeps the system block (skills + initial state) byte-identical
            s0, e0 = er.segments["state"]
            base = render(sc, tok, 0, "erratum")
            assert er.ids[:e0] == base.ids[:e0]
            if any(upd for x in sc.turns[: t + 1] for upd in x.updates):
                assert "[STATE UPDATE]" in er.text and "[STATE UPDATE]" not in ip.text
    assert n_updates > 0


def test_agent_blocks_are_standalone(qwen_tok):
    sc = build_scenarios(qwen_tok, True, n=1, block_length=80)[0]
    p = render(sc, qwen_tok, 1)
    for name in sc.domains:
        s, e = p.segments[f"skill:{name}"]
        assert list(p.ids[s:e]) == [i for line in sc.blocks[name] for i in encode(qwen_tok, line)]
