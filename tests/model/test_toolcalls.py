"""The grammar of strict tool calls (localchat/model/toolcalls.py), without a model: random
walks through its masks on the tiny tokenizer (a tool-call template, mlx-lm's JSON parser)
are replies a model could write; every call in one parses and each strict tool's arguments
validate against hypothesis-generated schemas. The control: the same walks with the tool not
strict give arguments that do not. Choices, a special-token marker, references and models
whose calls are not JSON."""

from __future__ import annotations

import json
import random
import types
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import build_tiny_model

from localchat.model.constraint import BadConstraint, Matcher, tokenizer_for
from localchat.model.endtokens import end_tokens, parser_markers
from localchat.model.replies import split_tool_calls
from localchat.model.tokenizer import load_tokenizer
from localchat.model.toolcalls import ToolRules, check_parameters, tool_grammar

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if tools %}<tool_call>{{ tool_call.name }}</tool_call>{% endif %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Vocab:
    """The tiny tokenizer wrapped as the engine has it, with llguidance's view."""

    def __init__(self, folder: Path):
        self.tok, _ = load_tokenizer(folder)
        self.ends = end_tokens(self.tok, folder, parser_markers(self.tok)).ends
        self.llt = tokenizer_for(self.tok, self.ends)
        self.engine = types.SimpleNamespace(tokenizer=self.tok)  # what split_tool_calls reads

    def grammar(self, tools: list[dict], rules: ToolRules):
        spec, why = tool_grammar(self.tok, tuple(tools), rules, lambda: self.llt)
        assert spec is not None, why
        return spec

    def walk(self, spec, seed: int, steps: int = 400) -> tuple[str, bool]:
        """A reply chosen at random among the tokens the grammar allows, leaning to an end
        (then to closing quotes and brackets) once allowed: (its text, whether it ended)."""
        rng = random.Random(seed)
        m = Matcher(spec, self.llt)
        out = []
        for _ in range(steps):
            bits = m.allowed_mask().view(np.uint32)
            allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
            ends = [t for t in allowed if t in self.ends]
            if ends and rng.random() < 0.7:
                return self.text(out), True
            t = int(rng.choice(allowed))
            m.consume(t)
            if t in self.ends:
                return self.text(out), True
            out.append(t)
        return self.text(out), False

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def tiny_with(folder: Path, special: bool = False) -> Path:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE  # (<tool_call> and tool_call.name: mlx-lm's json_tools)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if special:  # the markers as special tokens of their own, as some vocabularies have them
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.add_special_tokens(["<tool_call>", "</tool_call>"])
        tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Vocab:
    return Vocab(tiny_with(build_tiny_model(tmp_path_factory.mktemp("tc") / "tiny")))


def tool(name: str, schema: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def calls(vocab: Vocab, text: str, tools: list[dict]) -> list[dict]:
    return split_tool_calls(vocab.engine, text, tools)[1]


# Bounded object schemas: a walk closes them in a few hundred tokens.
LEAF = st.sampled_from([
    {"type": "integer", "minimum": -5, "maximum": 99}, {"type": "boolean"},
    {"enum": ["a", "서울", 3, None]}, {"type": "string", "maxLength": 4},
    {"type": "string", "pattern": "^[a-c]{2}$"}, {"const": "x"},
    {"type": "number", "minimum": 0, "maximum": 1}])


def objects(inner):
    return st.dictionaries(st.sampled_from(["a", "b", "city", "n", "키"]), inner,
                           min_size=1, max_size=3).flatmap(lambda props: st.builds(
                               lambda req: {"type": "object", "properties": props,
                                            "required": sorted(req),
                                            "additionalProperties": False},
                               st.sets(st.sampled_from(sorted(props)))))


SCHEMAS = objects(st.recursive(LEAF, lambda inner: objects(inner) | st.builds(
    lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner,
    st.integers(0, 2)), max_leaves=4))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_every_strict_call_of_a_walk_validates(vocab, schema, seed):
    check_parameters(schema, "parameters")
    tools = [tool("strict_one", schema), tool("loose_one", {"type": "object"})]
    spec = vocab.grammar(tools, ToolRules(strict=("strict_one",), choice="required"))
    text, ended = vocab.walk(spec, seed)
    found = calls(vocab, text, tools)
    if ended:
        assert found, text  # "required": the reply is calls
    for c in found:
        fn = c["function"]
        assert fn["name"] in ("strict_one", "loose_one")
        if fn["name"] == "strict_one":
            jsonschema.validate(fn["arguments"], schema)


def test_without_strict_the_same_walks_give_invalid_arguments(vocab):
    """The control: "required" with the tool loose holds the envelope, not the arguments."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}},
              "required": ["n"], "additionalProperties": False}
    results = {}
    for strict in (True, False):
        rules = ToolRules(strict=("f",) if strict else (), choice="required", parallel=False)
        spec = vocab.grammar([tool("f", schema)], rules)
        args = [c["function"]["arguments"] for seed in range(12)
                for c in calls(vocab, vocab.walk(spec, seed)[0], [tool("f", schema)])]
        results[strict] = [jsonschema.Draft202012Validator(schema).is_valid(a) for a in args]
    assert results[True] and all(results[True])
    assert results[False] and not all(results[False]), results


def test_auto_allows_free_text_but_never_a_marker_that_is_not_a_call(vocab):
    schema = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
              "additionalProperties": False}
    spec = vocab.grammar([tool("f", schema)], ToolRules(strict=("f",)))
    m = Matcher(spec, vocab.llt)
    ok = vocab.tok.encode("Just text, no call.", add_special_tokens=False)
    assert m.validate(ok) == len(ok)
    bad = vocab.tok.encode('Hi <tool_call>{"name": "g"', add_special_tokens=False)
    assert m.validate(bad) < len(bad)
    good = vocab.tok.encode('Hi <tool_call>\n{"name": "f", "arguments": {"x": true}}\n'
                            '</tool_call>', add_special_tokens=False)
    assert m.validate(good + [min(vocab.ends)]) == len(good) + 1


def test_required_named_and_single_calls(vocab):
    s = {"type": "object"}
    tools = [tool("f", s), tool("g", s)]
    enc = lambda text: vocab.tok.encode(text, add_special_tokens=False)  # noqa: E731
    call = lambda n: f'<tool_call>{{"name": "{n}", "arguments": {{}}}}</tool_call>'  # noqa: E731
    required = Matcher(vocab.grammar(tools, ToolRules(choice="required")), vocab.llt)
    assert required.validate(enc("Sure.")) == 0
    named = Matcher(vocab.grammar(tools, ToolRules(choice="function", name="g")), vocab.llt)
    assert named.validate(enc(call("g"))) == len(enc(call("g")))
    assert named.validate(enc(call("f"))) < len(enc(call("f")))
    both = enc(call("f") + "\n" + call("g"))
    one = Matcher(vocab.grammar(tools, ToolRules(choice="required", parallel=False)), vocab.llt)
    many = Matcher(vocab.grammar(tools, ToolRules(choice="required")), vocab.llt)
    assert one.validate(both) < len(both) == many.validate(both)
    with pytest.raises(BadConstraint, match="no offered tool is named 'h'"):
        vocab.grammar(tools, ToolRules(choice="function", name="h"))


def test_local_references_move_with_the_schema_and_others_are_refused(vocab):
    schema = {"type": "object", "required": ["p"], "additionalProperties": False,
              "properties": {"p": {"$ref": "#/$defs/two"}},
              "$defs": {"two": {"enum": ["A", "B"]}}}
    spec = vocab.grammar([tool("f", schema)], ToolRules(strict=("f",), choice="required"))
    for seed in range(5):
        text, ended = vocab.walk(spec, seed)
        for c in calls(vocab, text, [tool("f", schema)]):
            assert c["function"]["arguments"]["p"] in ("A", "B")
    anchored = {"type": "object", "properties": {"p": {"$ref": "#two"}}}
    with pytest.raises(BadConstraint, match="only local references"):
        vocab.grammar([tool("f", anchored)], ToolRules(strict=("f",)))


def test_a_special_token_marker_is_named_by_its_id(tmp_path):
    v = Vocab(tiny_with(build_tiny_model(tmp_path / "tiny"), special=True))
    marker = v.tok.encode("<tool_call>", add_special_tokens=False)
    assert len(marker) == 1 and v.llt.is_special_token(marker[0])
    schema = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"],
              "additionalProperties": False}
    spec = v.grammar([tool("f", schema)], ToolRules(strict=("f",), choice="required"))
    assert f"<[{marker[0]}]>" in spec.source
    text, ended = v.walk(spec, 1)
    (c,) = calls(v, text, [tool("f", schema)])[:1]
    assert c["function"]["arguments"]["x"] in (1, 2)


def test_models_whose_calls_are_not_json_run_free(vocab):
    pythonic = types.SimpleNamespace(has_tool_calling=True, tool_call_start="<|tool_call_start|>",
                                     tool_call_end="<|tool_call_end|>",
                                     tool_parser=types.SimpleNamespace(
                                         __module__="mlx_lm.tool_parsers.pythonic"))
    spec, why = tool_grammar(pythonic, (tool("f", {"type": "object"}),), ToolRules(strict=("f",)))
    assert spec is None and "pythonic" in why
    spec, why = tool_grammar(vocab.tok, (tool("f", {"type": "object"}),), ToolRules())
    assert spec is None and why == "no tool is strict"


@pytest.mark.parametrize("schema,says", [
    ({"type": "array"}, "must be {\"type\": \"object\""), (True, "must be {\"type\""),
    ({"type": "object", "properties": {"a": {"nullable": True}}}, "unsupported keyword"),
    ({"type": "object", "required": ["a"], "properties": {"a": {
        "type": "string", "minLength": 3, "maxLength": 2}}}, "admits nothing")])
def test_check_parameters_names_the_field(schema, says):
    with pytest.raises(BadConstraint, match=r"^tools\[0\]\.function\.parameters: ") as err:
        check_parameters(schema, "tools[0].function.parameters")
    assert says in str(err.value)
