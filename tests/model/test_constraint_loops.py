"""A constrained reply that loops (``model/loops.py``) is closed, valid, instead of running to its
cap unfinished; the closing state follows the tokens consumed, so verify rows agree with plain
decoding. Uses ``test_constraint.py``'s made-up model and tokenizer."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from test_constraint import Vocab, allowed, decode_forced, decode_plain, model

from localchat.model.constraint import Matcher, parse_spec


@pytest.fixture(scope="module")
def tiny(tiny_model) -> Vocab:
    return Vocab(tiny_model)
NOTES = {"type": "object", "properties": {
    "note": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["note", "tags"], "additionalProperties": False}


def looping_model(vocab: Vocab, phrase: str, seed: int = 0):
    """A model that, where the grammar lets it, writes ``phrase`` over and over (as the
    default model writes one Korean phrase inside a JSON string until its cap)."""
    cycle = vocab.encode(phrase)
    base = model(vocab, seed)

    def logits(prefix: tuple[int, ...]) -> np.ndarray:
        row = base(prefix) - 4.0 * vocab.closing  # (no lean to close: it would never)
        row[cycle[len(prefix) % len(cycle)]] += 50.0
        return row
    return logits


@pytest.mark.parametrize("phrase", ["la la land ", "서울 부산 "])
def test_a_reply_that_loops_is_closed_valid_and_verify_rows_agree(tiny: Vocab, phrase, monkeypatch):
    from localchat.model import constraint
    from localchat.model.loops import LOOP_LEAST

    spec = parse_spec("json_schema", NOTES)
    logits = looping_model(tiny, phrase)
    m = Matcher(spec, tiny.llt)
    plain = decode_plain(m, logits, 400)
    text = tiny.text(plain)
    assert m.stopped and m.closing and m.error is None
    jsonschema.validate(json.loads(text), NOTES)
    assert phrase.strip() in json.loads(text)["note"]  # it did loop, then closed
    assert len(plain) < 400 and len(plain) < len(tiny.encode(text)) + 2 * LOOP_LEAST
    # The same with forced tokens as verified drafts: the rows carry the closing state.
    forced, _ = decode_forced(Matcher(spec, tiny.llt), logits, 400)
    assert forced == plain
    # Negative control: without the loop check the same model runs to the cap, unfinished.
    monkeypatch.setattr(constraint, "looping", lambda ids: 0)
    m = Matcher(spec, tiny.llt)
    cut = decode_plain(m, logits, 400)
    assert len(cut) == 400 and not m.stopped and not m.accepting and not m.closing


def test_closing_is_rolled_back_with_the_tokens(tiny: Vocab):
    m = Matcher(parse_spec("json_schema", NOTES), tiny.llt)
    for tok in tiny.encode('{"note": "'):
        m.consume(tok)
    free = allowed(m)
    cycle = tiny.encode("la la land ")
    n = 0
    while not m.closing:
        m.consume(cycle[n % len(cycle)])
        n += 1
    closing = allowed(m)
    assert closing < free and all(
        not tiny.text([t]).strip().strip('"}]') for t in closing - set(tiny.ends))
    m.rollback(1)
    assert not m.closing and allowed(m) == free
    # masks() over a draft that makes the loop: its last row is the closing mask.
    rows = m.masks([cycle[(n - 1) % len(cycle)]])
    bits = np.unpackbits(rows[-1].view(np.uint8), bitorder="little")
    assert set(np.flatnonzero(bits).tolist()) == closing and not m.closing
