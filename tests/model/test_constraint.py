"""Structured output (localchat/model/constraint.py): every completed constrained reply parses
and validates, forced tokens as a verified draft give token for token what masking every step
gives, drafts are cut at the first refused token, and bad constraints are refused in one line.

The "model" here is a deterministic function of the token prefix (random scores seeded by the
prefix, a per-seed lean towards closing quotes and brackets so that replies end): greedy on it
chooses as wildly as a tiny random model, and both decode paths see the same model. The tiny
offline tokenizer (tests/tiny.py) runs by default; the real default model's 49k vocabulary is
``slow``. Timings are printed (``-s``), never asserted.
"""

from __future__ import annotations

import ast
import json
import re
import time
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localchat.model.constraint import (
    BadConstraint,
    Matcher,
    apply_masks,
    build_tokenizer,
    parse_spec,
    tokenizer_for,
)
from localchat.model.endtokens import end_tokens, parser_markers
from localchat.model.tokenizer import load_tokenizer

CLOSERS = ('"', "}", "]", ",")


class Vocab:
    """A tokenizer as the decode loop has it: ids, text, ends, llguidance's view."""

    def __init__(self, folder: Path):
        self.wrapper, _ = load_tokenizer(folder)
        self.ends = end_tokens(self.wrapper, folder, parser_markers(self.wrapper)).ends
        self.llt = tokenizer_for(self.wrapper, self.ends)
        backend = self.wrapper.backend_tokenizer
        self.size = self.llt.vocab_size
        texts = [backend.decode([i], skip_special_tokens=False) for i in range(self.size)]
        # Where the made-up model leans: tokens that close strings, objects and arrays, ends.
        self.closing = np.array([any(c in t for c in CLOSERS) for t in texts], dtype=np.float32)
        self.closing[list(self.ends)] = 1.0

    def encode(self, text: str) -> list[int]:
        return self.wrapper.encode(text, add_special_tokens=False)

    def text(self, tokens: list[int]) -> str:
        return self.wrapper.decode([t for t in tokens if t not in self.ends],
                                   skip_special_tokens=False)


def model(vocab: Vocab, seed: int):
    """Logits as a deterministic function of the prefix: the same "model" for every path."""
    lean = np.random.default_rng(seed).uniform(0.0, 4.0)

    def logits(prefix: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([seed, len(prefix), *prefix])
        return rng.standard_normal(vocab.size).astype(np.float32) + lean * vocab.closing
    return logits


def decode_plain(matcher: Matcher, logits, cap: int, mask: bool = True) -> list[int]:
    """Greedy, masking every step (``mask=False``: the negative control)."""
    out: list[int] = []
    while len(out) < cap and not matcher.stopped:
        row = mx.array(logits(tuple(out)))
        tok = int(mx.argmax(matcher.apply(row) if mask else row).item())
        if mask:
            matcher.consume(tok)
        out.append(tok)
        if tok in matcher.ends:
            break
    return out


def decode_forced(matcher: Matcher, logits, cap: int, mask_rows: bool = True
                  ) -> tuple[list[int], int]:
    """Greedy with the grammar's forced tokens as a draft, checked in one "verify pass" whose
    rows are masked (``mask_rows=False``: the negative control); (tokens, passes)."""
    out: list[int] = []
    passes = 0
    while len(out) < cap and not matcher.stopped:
        draft = matcher.forced()[:cap - len(out) - 1]
        rows = np.stack([logits(tuple(out + draft[:i])) for i in range(len(draft) + 1)])
        scores = mx.array(rows)
        if mask_rows:
            scores = apply_masks(scores, matcher.masks(draft))
        choice = mx.argmax(scores, axis=-1).tolist()
        passes += 1
        kept = next((i for i, t in enumerate(draft) if choice[i] != t), len(draft))
        for tok in [*draft[:kept], choice[kept]]:
            if matcher.stopped:  # complete: the end is implied, as in decode_plain
                break
            matcher.consume(tok)
            out.append(tok)
        if out[-1] in matcher.ends:
            break
    return out, passes


def completed(vocab: Vocab, spec, seeds, cap: int = 300) -> tuple[list[str], int]:
    """The texts of the replies that completed their grammar, and how many were cut."""
    done, cut = [], 0
    for seed in seeds:
        m = Matcher(spec, vocab.llt)
        tokens = decode_plain(m, model(vocab, seed), cap)
        assert m.error is None
        if m.stopped:
            done.append(vocab.text(tokens))
        else:
            cut += 1
    return done, cut


def check_json(texts: list[str], schema: dict) -> None:
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def tiny(tiny_model) -> Vocab:
    return Vocab(tiny_model)


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Vocab:
    """The default model's tokenizer (converted once into the test run's data folder)."""
    from localchat.model.resolve import resolve

    return Vocab(resolve(None).path)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "city": {"enum": ["서울", "부산", "Paris"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
             "minItems": 1, "maxItems": 3},
    "address": {"type": "object", "properties": {
        "street": {"type": "string", "pattern": "^[A-Za-z가-힣 ]{1,10}$"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"], "additionalProperties": False},
    "ok": {"type": "boolean"}},
    "required": ["name", "city", "age", "tags", "address"], "additionalProperties": False}
SCHEMAS = {
    "person": PERSON,
    "korean const": {"type": "object", "properties": {
        "capital": {"const": "서울"}, "note": {"type": "string", "maxLength": 8}},
        "required": ["capital", "note"], "additionalProperties": False},
    "array of enums": {"type": "array", "items": {"enum": ["red", "green", "파랑"]},
                       "minItems": 2, "maxItems": 4},
    "open object": {"type": "object", "properties": {"n": {"type": "number"}}},
    "anyOf": {"type": "object", "properties": {"v": {"anyOf": [
        {"type": "integer"}, {"type": "string", "maxLength": 4}, {"type": "null"}]}},
        "required": ["v"], "additionalProperties": False},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_models_write_valid_json_under_a_schema(tiny: Vocab, name: str):
    schema = SCHEMAS[name]
    texts, cut = completed(tiny, parse_spec("json_schema", schema), range(24))
    check_json(texts, schema)
    assert len(texts) >= 12, f"only {len(texts)} of 24 completed ({cut} cut)"


def test_json_object_is_any_object_and_true_any_value(tiny: Vocab):
    texts, _ = completed(tiny, parse_spec("json_object"), range(16))
    assert texts and all(isinstance(json.loads(t), dict) for t in texts)
    texts, _ = completed(tiny, parse_spec("json_schema", True), range(16))
    assert texts and all(json.loads(t) is not Ellipsis for t in texts)


def test_without_the_mask_the_same_models_write_invalid_json(tiny: Vocab):
    """Negative control: the harness above can fail."""
    spec = parse_spec("json_schema", PERSON)
    bad = 0
    for seed in range(8):
        text = tiny.text(decode_plain(Matcher(spec, tiny.llt), model(tiny, seed), 60,
                                      mask=False))
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError):
            bad += 1
    assert bad == 8


def test_regex_and_grammar_outputs_match(tiny: Vocab):
    pattern = r"(서울|부산)시 [0-9]{1,3}번지, [a-z]{2,5}@[a-z]{2,4}\.(com|kr)"
    texts, _ = completed(tiny, parse_spec("regex", pattern), range(16))
    assert len(texts) >= 8 and all(re.fullmatch(pattern, t) for t in texts), texts
    lark = ('start: expr\nexpr: term (("+" | "-") term)+\n'
            'term: NUMBER | "(" expr ")"\nNUMBER: /0|[1-9][0-9]{0,2}/\n')
    texts, _ = completed(tiny, parse_spec("grammar", lark), range(16))
    assert len(texts) >= 8
    for text in texts:  # arithmetic on integers, nothing else
        nodes = {type(n) for n in ast.walk(ast.parse(text, mode="eval"))}
        assert nodes <= {ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Constant}, text


# -- forced tokens, drafts, ends ---------------------------------------------------------------

LONG_NAMES = {"type": "object", "properties": {
    "the_name_of_the_city_in_question": {"type": "string", "maxLength": 6},
    "population_count_at_the_last_census": {"type": "integer", "minimum": 0},
    "is_this_the_capital_of_the_country": {"type": "boolean"}},
    "required": ["the_name_of_the_city_in_question", "population_count_at_the_last_census",
                 "is_this_the_capital_of_the_country"], "additionalProperties": False}


def test_forced_gives_the_field_name_tokens(tiny: Vocab):
    m = Matcher(parse_spec("json_schema", LONG_NAMES), tiny.llt)
    for tok in tiny.encode('{"'):
        m.consume(tok)
    forced = m.forced()
    assert tiny.text(forced).startswith("the_name_of_the_city_in_question")
    assert m.masks(forced).shape == (len(forced) + 1, m.words)


def test_forced_draft_verified_equals_masking_every_step(tiny: Vocab):
    """Token for token, in fewer model calls; and the forced count is in the usage."""
    spec = parse_spec("json_schema", LONG_NAMES)
    saved = 0
    for seed in range(12):
        plain = decode_plain(Matcher(spec, tiny.llt), model(tiny, seed), 200)
        m = Matcher(spec, tiny.llt)
        fast, passes = decode_forced(m, model(tiny, seed), 200)
        assert fast == plain, seed
        saved += len(plain) - passes
        usage = m.describe()
        assert usage.constrained == "json_schema" and usage.forced_tokens > 0
        assert usage.complete == (m.stopped or m.accepting)
    assert saved > 12 * 20  # the three long names are mostly forced


def test_verify_rows_unmasked_are_caught(tiny: Vocab):
    """Negative control: with the verify pass's rows unmasked, a refused token is accepted
    (consume refuses it) or the tokens differ from masking every step."""
    spec = parse_spec("json_schema", LONG_NAMES)
    caught = 0
    for seed in range(12):
        plain = decode_plain(Matcher(spec, tiny.llt), model(tiny, seed), 200)
        try:
            fast, _ = decode_forced(Matcher(spec, tiny.llt), model(tiny, seed), 200,
                                    mask_rows=False)
            caught += fast != plain
        except ValueError:
            caught += 1
    assert caught > 0


def test_masks_rows_are_the_step_by_step_masks(tiny: Vocab):
    m = Matcher(parse_spec("json_schema", PERSON), tiny.llt)
    draft = tiny.encode('{"name": "Seoul", "city": "서울"')
    assert m.validate(draft) == len(draft)
    rows = m.masks(draft)
    assert m.validate(draft) == len(draft)  # left where it was
    for i, tok in enumerate(draft):
        assert (rows[i] == m.allowed_mask()).all(), i
        m.consume(tok)
    assert (rows[-1] == m.allowed_mask()).all()


def test_validate_cuts_a_draft_at_the_first_refused_token(tiny: Vocab):
    m = Matcher(parse_spec("json_schema", PERSON), tiny.llt)
    good = tiny.encode('{"name": ')
    bad = tiny.encode("5")  # name is a string
    draft = good + bad + tiny.encode('"x"')
    assert m.validate(draft) == len(good)
    with pytest.raises(ValueError):
        m.masks(draft)
    for tok in good:
        m.consume(tok)
    with pytest.raises(ValueError):
        m.consume(bad[0])
    assert m.error is None  # refused before llguidance saw it: the matcher goes on
    assert m.validate([tiny.size + 5]) == 0  # an id past the vocabulary
    m.consume(tiny.encode('"')[0])


def test_end_tokens_only_where_the_grammar_accepts(tiny: Vocab):
    spec = parse_spec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                      "required": ["a"], "additionalProperties": False})
    m = Matcher(spec, tiny.llt)
    end = min(tiny.ends)
    body = tiny.encode('{"a": 12}')
    assert not (allowed(m) & tiny.ends)
    with pytest.raises(ValueError):
        m.consume(end)
    assert m.validate(body[:-1] + [end]) == len(body) - 1  # an end before the object closes
    assert m.validate(body + [end, body[0]]) == len(body) + 1  # nothing after an end
    for tok in body:
        m.consume(tok)
    assert m.stopped and m.accepting and not m.finished
    assert allowed(m) == set(tiny.ends)  # complete: only an end
    assert m.forced() == []
    m.consume(end)
    assert m.finished and m.describe().complete
    m.rollback(1)  # the end only (llguidance's own rollback would undo the "}")
    assert m.stopped and not m.finished and allowed(m) == set(tiny.ends)
    m.rollback(2)
    assert not m.accepting and tiny.encode("}")[0] in allowed(m)


def test_a_limit_met_mid_turn_ends_it_in_one_line(tiny: Vocab):
    """llguidance expands ``a{1000000}`` lazily: the check passes, and the first mask meets
    a lexer limit. The matcher is then in error for good: masks and consume raise."""
    m = Matcher(parse_spec("regex", "a{1000000}"), tiny.llt)
    a = tiny.encode("a")[0]
    start = time.perf_counter()
    with pytest.raises(BadConstraint, match=r"^regex: .*too many") as err:
        for _ in range(1000):
            m.allowed_mask()
            m.consume(a)
    print(f"a{{1000000}}: limit met in {1e3 * (time.perf_counter() - start):.0f} ms")
    assert "\n" not in str(err.value) and m.error and not m.stopped and not m.accepting
    assert m.forced() == [] and m.validate([a]) == 0
    for call in (m.allowed_mask, lambda: m.consume(a), lambda: m.masks([])):
        with pytest.raises(BadConstraint):
            call()


def test_an_end_is_allowed_beside_more_text_where_both_are(tiny: Vocab):
    m = Matcher(parse_spec("regex", "a+"), tiny.llt)
    m.consume(tiny.encode("a")[0])
    got = allowed(m)
    assert m.accepting and not m.stopped and set(tiny.ends) <= got and len(got) > len(tiny.ends)


def allowed(m: Matcher) -> set[int]:
    bits = np.unpackbits(m.allowed_mask().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


@pytest.mark.parametrize("extra", [-3, 0, 37])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_apply_masks_any_width_rows_and_dtype(tiny: Vocab, extra: int, dtype):
    m = Matcher(parse_spec("json_schema", PERSON), tiny.llt)
    width = tiny.size + extra
    logits = mx.random.normal((3, width)).astype(dtype)
    out = np.array(m.apply(logits).astype(mx.float32))
    ok = np.array(sorted(t for t in allowed(m) if t < width))
    assert np.isfinite(out[:, ok]).all()
    assert np.isneginf(np.delete(out, ok, axis=1)).all()  # extra columns refused too
    flat = m.apply(logits[0])
    assert flat.shape == (width,) and flat.dtype == dtype
    free = np.full(m.words, -1, dtype=np.int32)  # a free row of a batch
    both = np.array(apply_masks(logits[:2], np.stack([m.allowed_mask(), free])).astype(
        mx.float32))
    assert np.isfinite(both[1, :min(width, 32 * m.words)]).all()


# -- hypothesis-generated schemas ---------------------------------------------------------------

NAMES = st.text(alphabet="abcxyz_한국", min_size=1, max_size=8)
LEAVES = st.one_of(
    st.just({"type": "string"}),
    st.tuples(st.integers(0, 3), st.integers(0, 6)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}),
    st.just({"type": "integer"}),
    st.tuples(st.integers(-500, 500), st.integers(0, 10_000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.lists(st.text(alphabet="ab서울 ", min_size=1, max_size=5), min_size=1, max_size=4,
             unique=True).map(lambda xs: {"enum": xs}))


def schemas(depth: int = 3) -> st.SearchStrategy:
    if depth == 0:
        return LEAVES
    inner = schemas(depth - 1)
    arrays = st.tuples(inner, st.integers(0, 2), st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    objects = st.tuples(st.dictionaries(NAMES, inner, min_size=1, max_size=4), st.booleans(),
                        st.booleans()).map(_object)
    return st.one_of(LEAVES, arrays, objects)


def _object(t) -> dict:
    props, closed, all_required = t
    schema = {"type": "object", "properties": props,
              "required": sorted(props) if all_required else sorted(props)[:1]}
    if closed:
        schema["additionalProperties"] = False
    return schema


def test_generated_schemas_constrain_random_models(tiny: Vocab):
    seen = {"done": 0, "cut": 0}

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(schemas(3).filter(lambda s: s.get("type") in ("object", "array")))
    def check(schema: dict):
        texts, cut = completed(tiny, parse_spec("json_schema", schema), range(2), cap=400)
        check_json(texts, schema)
        seen["done"] += len(texts)
        seen["cut"] += cut

    check()
    print(f"generated schemas: {seen['done']} replies completed, {seen['cut']} cut at the cap")
    assert seen["done"] >= seen["cut"], seen


# -- other tokenizers ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["mistral", "gemma3", "qwen3"])
def test_other_tokenizer_shapes(family: str, tmp_path: Path):
    """SentencePiece-style BPE with byte fallback (Mistral, Gemma) and byte-level BPE with
    markers (Qwen 3): Korean and JSON come out whole."""
    from published import build

    vocab = Vocab(build(family, tmp_path / family))
    schema = SCHEMAS["korean const"]
    texts, _ = completed(vocab, parse_spec("json_schema", schema), range(8))
    check_json(texts, schema)
    assert texts


def test_the_tokenizer_is_built_once_per_tokenizer(tiny: Vocab):
    assert tokenizer_for(tiny.wrapper, tiny.ends) is tiny.llt
    assert build_tokenizer(tiny.wrapper, tiny.ends) is not tiny.llt
    with pytest.raises(BadConstraint):
        build_tokenizer(object(), tiny.ends)


# -- the default model's tokenizer (slow) --------------------------------------------------------


@pytest.mark.slow
def test_default_model_tokenizer(real: Vocab):
    start = time.perf_counter()
    build_tokenizer(real.wrapper, real.ends)
    built = time.perf_counter() - start
    start = time.perf_counter()
    assert tokenizer_for(real.wrapper, real.ends) is real.llt
    print(f"llguidance tokenizer for {real.size} tokens: built in {built:.3f} s, cached "
          f"{1e6 * (time.perf_counter() - start):.0f} µs")
    for name in ("person", "korean const", "array of enums"):
        texts, _ = completed(real, parse_spec("json_schema", SCHEMAS[name]), range(6))
        check_json(texts, SCHEMAS[name])
        assert len(texts) >= 3, name
    m = Matcher(parse_spec("json_schema", LONG_NAMES), real.llt)
    for tok in real.encode('{"'):
        m.consume(tok)
    assert real.text(m.forced()) == "the_name_of_the_city_in_question"
    spec = parse_spec("json_schema", LONG_NAMES)
    for seed in range(3):
        plain = decode_plain(Matcher(spec, real.llt), model(real, seed), 120)
        fast, passes = decode_forced(Matcher(spec, real.llt), model(real, seed), 120)
        assert fast == plain and passes < len(plain)
