"""Constrained turns (``model/constraint.py`` beside the sampler) through the session: every
reply parses and validates, the cache is untouched by the grammar (every family resumes
exactly after a constrained turn), and lookup decoding with the grammar's forced tokens is
token for token the plain constrained decode.

Tiny random models choose wildly: without the mask they never write JSON (checked below),
with it every complete reply validates, which makes them a good fuzz of the masks.
"""

from __future__ import annotations

import re

import pytest
from families import FAMILIES
from shapes import valid

from localchat import paths
from localchat.model.constraint import parse_spec
from localchat.model.sampler import Sampler
from localchat.session.session import Session, TurnOptions

PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"enum": ["Seoul", "Paris", "서울"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                  "minItems": 1, "maxItems": 3}}}
# Ten long field names: most of a reply is forced (the grammar's only choice).
LONG = {"type": "object", "additionalProperties": False,
        "required": [f"the_{w}_field_of_this_record" for w in "abcdefghij"],
        "properties": {f"the_{w}_field_of_this_record": {"type": "boolean"}
                       for w in "abcdefghij"}}
PROMPTS = ["Hello there, tell me about Seoul.", "What is the capital of France?",
           "안녕하세요, 서울에 대해 알려 주세요.", "Numbers 0 1 2 3 please"]


@pytest.fixture(scope="module")
def built(family_engine):
    return family_engine


def fresh(store, engine) -> Session:
    """A session with nothing in memory: each turn's cache comes from disk."""
    return Session(store, engine, paths.kv_root(), paths.locks_dir())


def run(session, conv, prompt, **kw):
    events = list(session.turn(conv, prompt, TurnOptions(**{"max_tokens": 64, **kw})))
    return events[-1]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_constrained_turn_then_turns_resumed_from_disk_equal_full_prefills(
        home, store, built, family):
    """Grammar state never enters the cache: the reply is stored like any, and the next
    turns (constrained and free) resume from disk to the tokens of a full prefill."""
    engine = built(family)
    shape = parse_spec("json_schema", PERSON)
    digits = parse_spec("regex", r"[0-9]{2,4}( [a-z]{1,5}){1,3}")
    resumed = store.create("r", engine.ref.name)
    twin = store.create("t", engine.ref.name)
    turns = [(PROMPTS[0], shape, 96), (PROMPTS[1], None, 16), (PROMPTS[2], digits, 24)]
    previous = None
    replies = []
    for i, (prompt, constraint, cap) in enumerate(turns):
        got = run(fresh(store, engine), resumed, prompt, constraint=constraint, max_tokens=cap)
        ref = run(fresh(store, engine), twin, prompt, constraint=constraint, max_tokens=cap,
                  no_cache=True)
        assert got.tokens == ref.tokens, f"turn {i + 1}"
        assert ref.usage.cached_tokens == 0
        if previous is not None:
            u = previous.usage
            assert got.usage.cached_tokens >= u.prompt_tokens + u.completion_tokens - 2
            assert got.usage.miss_reason == ""
        if constraint is shape:
            assert got.usage.constrained == "json_schema"
            assert got.complete is valid(PERSON, got.reply), got.reply
        elif constraint is digits:
            assert got.complete is bool(re.fullmatch(r"[0-9]{2,4}( [a-z]{1,5}){1,3}",
                                                     got.reply)), got.reply
        else:
            assert got.complete is None and got.usage.constrained == ""
        previous = got
        replies.append(got.reply)
    # What is stored is the reply text, as any reply's.
    assert [m.content for m in store.messages(resumed) if m.role == "assistant"] == replies


def test_every_complete_reply_validates_and_the_mask_is_what_makes_it(home, store, engine):
    """Greedy and sampled, English and Korean: each reply that completes validates; the same
    prompts unconstrained give no valid JSON at all (the test could fail)."""
    session = fresh(store, engine)
    shape = parse_spec("json_schema", PERSON)
    done = 0
    for i, prompt in enumerate(PROMPTS * 2):
        conv = store.create(f"c{i}", engine.ref.name)
        temp = 0.0 if i < len(PROMPTS) else 0.9
        got = run(session, conv, prompt, constraint=shape, max_tokens=160, temp=temp, seed=i)
        assert got.complete is valid(PERSON, got.reply), got.reply
        done += got.complete
        free = run(session, store.create(f"f{i}", engine.ref.name), prompt, max_tokens=160,
                   temp=temp, seed=i)
        assert not valid(PERSON, free.reply)
    assert done >= 4  # most finish within 160 tokens


@pytest.mark.parametrize("schema", [PERSON, LONG], ids=["person", "long-names"])
def test_lookup_with_forced_tokens_equals_plain_constrained_decoding(home, store, engine,
                                                                     schema):
    shape = parse_spec("json_schema", schema)
    forced = 0
    for i, prompt in enumerate(PROMPTS):
        plain = run(fresh(store, engine), store.create(f"p{i}", engine.ref.name), prompt,
                    constraint=shape, max_tokens=200, speculate="off")
        fast = run(fresh(store, engine), store.create(f"l{i}", engine.ref.name), prompt,
                   constraint=shape, max_tokens=200, speculate="lookup")
        assert fast.tokens == plain.tokens, prompt
        assert plain.usage.forced_tokens == 0
        forced += fast.usage.forced_tokens
    assert forced > (200 if schema is LONG else 20)


def test_negative_control_verification_without_the_grammar_is_caught(home, store, engine,
                                                                     monkeypatch):
    """With the rows of a verify pass left unmasked, the model's own choice after a draft is
    taken: the grammar refuses it (or the tokens differ). The equality test above would see
    it."""
    shape = parse_spec("json_schema", LONG)
    plain = [run(fresh(store, engine), store.create(f"p{i}", engine.ref.name), p,
                 constraint=shape, max_tokens=120, speculate="off").tokens
             for i, p in enumerate(PROMPTS)]
    original = Sampler.verify

    def unmasked(self, logits, draft):
        grammar, self.grammar = self.grammar, None
        try:
            return original(self, logits, draft)
        finally:
            self.grammar = grammar

    monkeypatch.setattr(Sampler, "verify", unmasked)
    caught = 0
    for i, p in enumerate(PROMPTS):
        try:
            got = run(fresh(store, engine), store.create(f"n{i}", engine.ref.name), p,
                      constraint=shape, max_tokens=120, speculate="lookup").tokens
        except ValueError:  # the grammar refused the unmasked choice
            caught += 1
            continue
        caught += got != plain[i]
    assert caught >= 1


def test_a_reply_cut_by_its_cap_is_not_complete(home, store, engine):
    got = run(fresh(store, engine), store.create("cut", engine.ref.name), PROMPTS[0],
              constraint=parse_spec("json_schema", LONG), max_tokens=12)
    assert got.finish == "length" and got.complete is False
    assert not valid(LONG, got.reply)
