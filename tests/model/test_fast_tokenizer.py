"""The fast tokenizer path (``localchat/model/tokenizer/``) equals transformers, for the families
people run (``tests/published.py``): the Rust tokenizer it builds, token ids, decoded text,
rendered prompts (system prompts, tools, tool results, reasoning on and off, multi-turn, and
generated text: Korean, emoji, control characters, markup), the reasoning markers and tool
parsers mlx-lm finds, and streamed text (the whole decode, never half a character).
Each equality has a negative control that shows it can tell a difference."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import published
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localchat.model.tokenizer import (
    FAST,
    SLOW,
    detokenizer_for,
    load_tokenizer,
    plan,
    same_as,
    wrap,
)
from localchat.model.tokenizer.fast import FastTokenizer, read_settings
from localchat.model.tokenizer.stream import StreamDetokenizer

FAMILIES = sorted(published.FAMILIES)
TEXT = st.lists(st.one_of(
    st.sampled_from(list("안녕하세요한국어 👍🏽🎉é\x00\x1b\t\r\n <>[]/{}\"'\\|")),
    st.sampled_from(["<|im_end|>", "<think>", "</think>", "[INST]", "<s>", "<bos>",
                     "<tool_call>", "[/b]", "<|eot_id|>", "<|channel|>", "<｜User｜>"]),
    st.characters(codec="utf-8")), max_size=30).map("".join)
SLOW_OK = settings(max_examples=40, deadline=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture])


@functools.cache
def pair(family: str, plain: bool = True):
    """(fast tokenizer, transformers' tokenizer) of a family's folder, built once."""
    import tempfile

    from transformers import AutoTokenizer

    folder = published.build(family, Path(tempfile.mkdtemp()) / family, plain=plain)
    return FastTokenizer(read_settings(folder, any_class=not plain)), \
        AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_folders_take_the_fast_path_with_transformers_own_tokenizer(family):
    fast, hf = pair(family)
    assert plan(Path(fast.name_or_path)).path == FAST
    assert same_as(fast, hf) is None  # the whole Rust tokenizer, specials, template…
    assert (fast.vocab_size, len(fast), fast.eos_token_id, fast.bos_token_id,
            fast.all_special_ids, fast.model_max_length) == \
        (hf.vocab_size, len(hf), hf.eos_token_id, hf.bos_token_id, hf.all_special_ids,
         hf.model_max_length)


def test_negative_control_a_missing_special_token_is_seen(tmp_path):
    """A named token the tokenizer.json lacks is added as transformers adds it; without
    that step the ids differ, and ``same_as`` says so."""
    from transformers import AutoTokenizer

    folder = published.build("llama3", tmp_path / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["image_token"] = "<image>"  # a model's own named token, in no vocabulary
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    hf, fast = AutoTokenizer.from_pretrained(folder), FastTokenizer(read_settings(folder))
    assert fast.encode("a <image> b") == hf.encode("a <image> b")
    settings_ = read_settings(folder)
    del settings_.special["image_token"]
    wrong = FastTokenizer(settings_)
    assert wrong.encode("a <image> b") != hf.encode("a <image> b")
    assert same_as(wrong, hf) is not None


@pytest.mark.parametrize("family", FAMILIES)
@SLOW_OK
@given(text=TEXT)
def test_token_ids_and_decoded_text_equal_transformers(family, text):
    fast, hf = pair(family)
    for specials in (False, True):
        ids = hf.encode(text, add_special_tokens=specials)
        assert fast.encode(text, add_special_tokens=specials) == ids
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == \
                hf.decode(ids, skip_special_tokens=skip)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer"}}},
        "required": ["city"]}}}]
CALL = {"type": "function", "id": "call12345",
        "function": {"name": "get_weather", "arguments": {"city": "서울", "unit": "celsius"}}}
CONVERSATIONS = {
    "one user message": [{"role": "user", "content": "Hello!"}],
    "system prompt": [{"role": "system", "content": "Be brief. 짧게."},
                      {"role": "user", "content": "안녕하세요 👍"}],
    "multi-turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                   {"role": "user", "content": "  spaces  and\ttabs\n"},
                   {"role": "assistant", "content": "<think>\nhm\n</think>\n\nOk."},
                   {"role": "user", "content": "<b>[/b]</b> \x1b[31m"}],
    "reasoning in history": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
        {"role": "user", "content": "3+3?"}],
    "tool call and result": [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": "Weather in Seoul?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
         "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 °C."}, {"role": "user", "content": "Thanks"}],
}


def render_both(family: str, messages, **kwargs):
    """(transformers' text or its error, ours or its error)."""
    fast, hf = pair(family)
    out = []
    for tok in (hf, fast):
        try:
            out.append(tok.apply_chat_template(messages, tokenize=False, **kwargs))
        except Exception as err:  # noqa: BLE001 - the same refusal from both is equality
            out.append(f"{type(err).__name__}: {err}")
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_rendered_prompts_equal_apply_chat_template(family, case, thinking, tools):
    kwargs = {"add_generation_prompt": True, "tools": tools,
              **({"enable_thinking": thinking} if thinking is not None else {})}
    theirs, ours = render_both(family, CONVERSATIONS[case], **kwargs)
    assert ours == theirs
    fast, hf = pair(family)
    if not theirs.startswith(("TemplateError", "TypeError", "UndefinedError")):
        assert fast.encode(ours, add_special_tokens=False) == \
            hf.encode(theirs, add_special_tokens=False)


def test_every_family_renders_some_case_without_refusing():
    """(so the equalities above are not all between two identical errors)"""
    for family in FAMILIES:
        texts = [render_both(family, m, add_generation_prompt=True)[0]
                 for m in CONVERSATIONS.values()]
        assert sum(not t.startswith(("TemplateError", "TypeError")) for t in texts) >= 2, \
            family


def test_negative_control_a_different_environment_renders_differently():
    """Without transformers' ``trim_blocks``/``lstrip_blocks`` (or its ``tojson``) the
    published templates render other text: the equality above can fail."""
    import jinja2.sandbox

    from localchat.model.tokenizer import template as chat

    fast, hf = pair("qwen3")
    messages = CONVERSATIONS["tool call and result"]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()  # jinja's own defaults
    env.globals["raise_exception"] = chat.raise_exception
    wrong = env.from_string(published.template("qwen3")).render(
        messages=messages, tools=TOOLS, add_generation_prompt=True,
        **hf.special_tokens_map)
    right = hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=False)
    assert wrong != right


@pytest.mark.parametrize("family", FAMILIES)
@SLOW_OK
@given(contents=st.lists(TEXT, min_size=1, max_size=5), system=st.one_of(st.none(), TEXT),
       thinking=st.sampled_from([None, True, False]))
def test_generated_conversations_render_equal(family, contents, system, thinking):
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": c}
        for i, c in enumerate(contents)]
    kwargs = {"add_generation_prompt": True,
              **({"enable_thinking": thinking} if thinking is not None else {})}
    theirs, ours = render_both(family, messages, **kwargs)
    assert ours == theirs


# -- the path a folder takes ---------------------------------------------------------------


# Published tokenizer classes that transformers builds from tokenizer.json as it is (checked
# once, then fast) and those that rebuild their own pipeline (transformers every time).
CHECKED_FAST = {"llama3", "gpt_oss", "mistral", "deepseek_r1", "phi4", "phi3"}


@pytest.mark.parametrize("family", FAMILIES)
def test_published_classes_are_checked_once_then_fast_where_transformers_agrees(
        family, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCHAT_HOME", str(tmp_path / "home"))
    folder = published.build(family, tmp_path / family, plain=False)
    first, how = load_tokenizer(folder)
    second, then = load_tokenizer(folder)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    assert then.path == (FAST if family in CHECKED_FAST else SLOW), then
    text = first.apply_chat_template(CONVERSATIONS["multi-turn"], add_generation_prompt=True,
                                     tokenize=False)
    for tok in (first, second):
        assert tok.encode(text, add_special_tokens=False) == \
            hf.encode(text, add_special_tokens=False)
    # A changed file is checked again (the memo is keyed by the files' digest).
    if then.path == FAST and published.FAMILIES[family].cls != "PreTrainedTokenizerFast":
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["model_max_length"] = 8
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        assert plan(folder).path == SLOW


def test_a_folder_with_only_a_sentencepiece_model_takes_transformers(tmp_path):
    folder = published.build("mistral", tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    assert plan(folder).path == SLOW and "no tokenizer.json" in plan(folder).reason


def test_the_replaced_class_list_is_transformers_own():
    from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

    from localchat.model.tokenizer.fast import REPLACED_CLASS_TYPES

    assert REPLACED_CLASS_TYPES == set(MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)


@pytest.mark.parametrize("family", FAMILIES)
def test_markers_tool_parsers_and_eos_agree_with_mlx_lm(family):
    from mlx_lm.tokenizer_utils import load

    fast, _ = pair(family)
    ours, theirs = wrap(fast, [7]), load(Path(fast.name_or_path), eos_token_ids=[7])
    for name in ("eos_token_ids", "has_thinking", "think_start", "think_end",
                 "think_start_tokens", "think_end_tokens", "has_tool_calling",
                 "tool_call_start", "tool_call_end", "has_chat_template", "vocab_size"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert (ours.tool_parser is None) == (theirs.tool_parser is None)
    if ours.tool_parser is not None:
        assert ours.tool_parser.__module__ == theirs.tool_parser.__module__
    messages = CONVERSATIONS["reasoning in history"]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, add_generation_prompt=True)


# -- streaming -------------------------------------------------------------------------------


def streamed(tok, ids: list[int]) -> list[str]:
    detok = detokenizer_for(tok)
    pieces = []
    for i in ids:
        detok.add_token(i)
        pieces.append(detok.last_segment)
    detok.finalize()
    pieces.append(detok.last_segment)
    return pieces


@pytest.mark.parametrize("family", ["smollm2", "mistral", "gemma3", "gpt_oss"])
@SLOW_OK
@given(data=st.data())
def test_streamed_text_is_the_whole_decode_for_any_tokens(family, data):
    fast, _ = pair(family)
    ids = data.draw(st.lists(st.integers(0, len(fast) - 1), max_size=30))
    whole = fast.decode(ids, skip_special_tokens=False)
    assert "".join(streamed(fast, ids)) == whole


@pytest.mark.parametrize("family", ["smollm2", "mistral", "gemma3"])
@SLOW_OK
@given(text=TEXT)
def test_streamed_text_never_splits_a_character(family, text):
    """Text a model could write (Hangul and emoji come as byte pieces or ``<0xEC>``
    byte-fallback tokens) streams in whole characters only."""
    fast, _ = pair(family)
    ids = fast.encode(text, add_special_tokens=False)
    pieces = streamed(fast, ids)
    assert "".join(pieces) == fast.decode(ids)
    assert not any("\ufffd" in p for p in pieces) or "\ufffd" in text


def test_byte_fallback_pieces_of_one_character_wait_for_the_last():
    fast, _ = pair("mistral")
    ids = fast.encode("한", add_special_tokens=False)
    assert [fast.convert_ids_to_tokens(i) for i in ids[-3:]] == ["<0xED>", "<0x95>", "<0x9C>"]
    pieces = streamed(fast, ids)
    n = len(ids)
    # (a run of byte tokens goes out when it ends: here at the end of the reply)
    assert pieces[n - 3:n] == ["", "", ""] and pieces[n].endswith("한")
    assert "".join(pieces) == fast.decode(ids) == "한"


def test_negative_control_token_by_token_decoding_splits_characters():
    """Decoding each token alone (what a naive stream does) is not the whole decode: the
    tests above could fail."""
    fast, _ = pair("smollm2")
    ids = fast.encode("안녕하세요 👍🏽", add_special_tokens=False)
    naive = "".join(fast.decode([i]) for i in ids)
    assert naive != fast.decode(ids)
    assert "".join(streamed(fast, ids)) == fast.decode(ids)


def test_a_reply_cut_mid_character_ends_as_the_whole_decode_does():
    for family in ("smollm2", "mistral"):
        fast, _ = pair(family)
        ids = fast.encode("🦜", add_special_tokens=False)[:-1]
        assert ids and "".join(streamed(fast, ids)) == fast.decode(ids)


def test_reset_starts_over():
    detok = StreamDetokenizer(lambda ids: "".join(chr(65 + i) for i in ids))
    detok.add_token(1)
    detok.reset()
    detok.add_token(2)
    assert (detok.text, detok.tokens) == ("C", [2])
