"""A reply ends when the model is done: every end-of-generation token of the model ends it, and
no special token is ever reply text — through a turn, ``ask``, the app and both server APIs.

The tiny tokenizer is SmolLM2's shape: ``<|im_end|>`` is its EOS, ``<|endoftext|>`` (id 0) an
end-of-document special it may also write, ``<|im_start|>`` a control token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import ScriptedEngine
from tiny import build_tiny_model

from localchat import paths
from localchat.events import ReplyChunk, TurnFinished
from localchat.model.endtokens import end_tokens
from localchat.model.engine import Engine
from localchat.session.session import Session, TurnOptions

OTHER_ENDS = ("<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|return|>", "<|end|>", "</s>")
TAIL = " Gabon is a nation in Central Africa"  # what a model writes after its end token


@pytest.fixture(scope="module")
def many_ends(tmp_path_factory) -> Path:
    """The tiny model with other families' end tokens in its vocabulary too."""
    return build_tiny_model(tmp_path_factory.mktemp("ends") / "tiny-ends",
                            extra_special=OTHER_ENDS)


def scripted_turn(store, engine, reply: str, name: str = "c") -> tuple[TurnFinished, str]:
    """One turn whose model writes ``reply`` (then its EOS); (finished, streamed text)."""
    scripted = ScriptedEngine(engine, [reply])
    session = Session(store, scripted, paths.kv_root(), paths.locks_dir())
    conv = session.conversation(name)
    events = list(session.turn(conv, "What is the capital of France?", TurnOptions()))
    streamed = "".join(e.text for e in events if isinstance(e, ReplyChunk))
    return events[-1], streamed


def test_the_tiny_models_end_set(engine):
    ends = engine.end_tokens()
    tok = engine.tokenizer
    assert ends.ends == {tok.convert_tokens_to_ids("<|im_end|>"),
                         tok.convert_tokens_to_ids("<|endoftext|>")}
    assert tok.convert_tokens_to_ids("<|im_start|>") in ends.hidden - ends.ends
    assert ends.sources == ("tokenizer EOS", "end-of-turn specials")
    # mlx-lm's own loops (batch --parallel) stop on the same set.
    assert ends.ends <= set(tok.eos_token_ids)


def test_generation_config_ids_end_a_reply_and_bad_values_add_nothing(tiny_model, tmp_path):
    folder = tmp_path / "m"
    import shutil

    shutil.copytree(tiny_model, folder)
    base = Engine.load(str(folder))
    word = base.encode(" Gabon")[0]
    assert word not in base.eos_ids  # negative control: a plain word piece
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, word]}))
    assert word in end_tokens(base.tokenizer, folder).ends
    assert "generation_config.json" in end_tokens(base.tokenizer, folder).sources
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": word}))
    assert word in end_tokens(base.tokenizer, folder).ends
    for bad in ('{"eos_token_id": "7"}', '{"eos_token_id": [-1, true]}', "[1, 2]", "{not json"):
        (folder / "generation_config.json").write_text(bad)
        assert end_tokens(base.tokenizer, folder).ends == base.eos_ids


def test_generation_config_end_through_a_turn(tiny_model, tmp_path, home, store):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    word = Engine.load(str(folder)).encode(" Gabon")[0]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, word]}))
    engine = Engine.load(str(folder))
    done, streamed = scripted_turn(store, engine, "Paris." + TAIL)
    assert (done.reply, streamed, done.finish) == ("Paris.", "Paris.", "stop")
    assert done.tokens[-1] == word


def test_gpt_oss_framing_is_not_an_end():
    """gpt-oss writes ``<|end|>`` between its analysis and its answer: a reasoning marker
    (kept, not an end); ``<|return|>`` ends the reply."""
    from tokenizers import AddedToken, Tokenizer, models

    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    names = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
    tok.add_special_tokens([AddedToken(n, special=True) for n in names])
    ids = {n: tok.token_to_id(n) for n in names}
    wrapper = SimpleNamespace(eos_token_ids={ids["<|return|>"]},
                              _tokenizer=SimpleNamespace(backend_tokenizer=tok))
    from localchat.model.replies import HARMONY

    got = end_tokens(wrapper, None, HARMONY)
    assert got.ends == {ids["<|return|>"], ids["<|call|>"]}
    assert ids["<|channel|>"] not in got.hidden
    plain = end_tokens(wrapper, None)  # negative control: without the markers it would end
    assert ids["<|end|>"] in plain.ends


@pytest.mark.parametrize("end", ("<|endoftext|>",) + OTHER_ENDS)
def test_each_end_token_ends_the_reply_and_is_never_text(many_ends, home, store, end):
    engine = Engine.load(str(many_ends))
    assert engine.encode(end) == [engine.tokenizer.convert_tokens_to_ids(end)]
    done, streamed = scripted_turn(store, engine, "Paris." + end + TAIL)
    assert (done.reply, streamed, done.finish) == ("Paris.", "Paris.", "stop")
    assert done.tokens[-1] in engine.eos_ids
    stored = store.messages(store.get("c"))
    assert [m.content for m in stored][-1] == "Paris."


def test_a_control_token_in_a_reply_is_not_text(engine, home, store):
    done, streamed = scripted_turn(store, engine, "Pa<|im_start|>ris.")
    assert (done.reply, streamed) == ("Paris.", "Paris.")
    assert engine.tokenizer.convert_tokens_to_ids("<|im_start|>") in done.tokens


def test_decode_never_samples_a_control_token(engine):
    """The real decode loop: a control token the model prefers is skipped; an end it prefers
    ends the reply (negative control)."""
    import mlx.core as mx

    start = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = engine.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for favourite, expect_end in ((start, False), (end, True)):
        cache = engine.new_cache()
        logits = engine.prefill(engine.encode("Hello"), cache)
        try:
            while True:
                next(logits)
        except StopIteration as fin:
            logits = fin.value
        boosted = logits + mx.where(mx.arange(logits.shape[-1]) == favourite, 1e4, 0.0)
        got = list(engine.decode(cache, boosted, 3))
        assert (got[0] == end) is expect_end
        assert start not in got


def test_ask_stops_at_an_end_token(home, tiny_model):
    env = {**os.environ, "LOCALCHAT_HOME": str(home),
           "SCRIPTED_REPLIES": json.dumps(["Paris.<|endoftext|>" + TAIL]),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.getcwd()])}
    out = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "scripted_serve.py"),
                          "ask", "-m", str(tiny_model), "--json", "Capital of France?"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert record["reply"] == "Paris."
    assert record["usage"]["completion_tokens"] == len(Engine.load(str(tiny_model))
                                                       .encode("Paris.")) + 1


async def test_the_app_shows_the_reply_up_to_the_end_token(make_app):
    from test_tui import replies, settle, type_and_send

    app, _ = make_app(["Paris.<|endoftext|>" + TAIL, "Seoul.<|im_end|>" + TAIL])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "Capital of France?")
        await settle(app, pilot)
        await type_and_send(pilot, "And of Korea?")
        await settle(app, pilot)
        assert replies(app) == ["Paris.", "Seoul."]
        stored = [m.content for m in app.store.messages(app.current)]
        assert stored == ["Capital of France?", "Paris.", "And of Korea?", "Seoul."]


def test_both_apis_stop_at_an_end_token_streamed_and_not(server):
    s = server("llama", scripted=["Paris.<|endoftext|>" + TAIL] * 4)
    ask = [{"role": "user", "content": "Capital of France?"}]
    client = s.openai()
    one = client.chat.completions.create(model="localchat", messages=ask, max_tokens=64)
    assert (one.choices[0].message.content, one.choices[0].finish_reason) == ("Paris.", "stop")
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="localchat", messages=ask, max_tokens=64, stream=True) if c.choices)
    assert text == "Paris."
    claude = s.anthropic()
    msg = claude.messages.create(model="localchat", messages=ask, max_tokens=64)
    assert ([b.text for b in msg.content], msg.stop_reason) == (["Paris."], "end_turn")
    with claude.messages.stream(model="localchat", messages=ask, max_tokens=64) as stream:
        assert "".join(stream.text_stream) == "Paris."


LOOP = "Paris." + ", laQUEE" * 60  # how the default model's runaway reply ended (issue 35)


def test_a_reply_stuck_in_a_loop_is_cut_with_a_notice_and_the_next_turn_appends(
        engine, home, store):
    import re

    from localchat.events import Notice
    from localchat.model.loops import LOOP_LEAST, LOOP_PERIOD, LOOP_REPEATS, loop_span

    after = "Seoul, la France, le Canada, la France, le Canada."  # repeats, but no loop
    # Repeats a reply means, under the loop's size: four copies of a short stretch in fewer
    # than LOOP_LEAST tokens, and three copies (not LOOP_REPEATS) of a long line.
    hellos = " ".join(["hello"] * 12)
    lines = "Three times:" + " The old bridge was rebuilt." * 3
    copy = len(engine.encode(" The old bridge was rebuilt."))
    assert len(engine.encode(hellos)) < LOOP_LEAST <= 3 * copy <= 3 * LOOP_PERIOD
    assert LOOP_REPEATS == 4
    scripted = ScriptedEngine(engine, [LOOP, after, hellos, lines, LOOP])
    session = Session(store, scripted, paths.kv_root(), paths.locks_dir())
    conv = session.conversation("loop")
    sampled = TurnOptions(max_tokens=1024, temp=0.7)  # (the scripted model ignores it)
    events = list(session.turn(conv, "What is the capital of France?", sampled))
    done, notes = events[-1], [e.text for e in events if isinstance(e, Notice)]
    whole = len(engine.encode(LOOP))
    said = [re.fullmatch(r"reply cut: it repeated the same (\d+) tokens over its last (\d+)", n)
            for n in notes]
    said = [m for m in said if m]
    assert len(said) == 1 and "\n" not in notes[-1]
    period, span = int(said[0][1]), int(said[0][2])
    assert span == loop_span(period) and period <= len(engine.encode(", laQUEE")) + 1
    head = len(engine.encode("Paris."))
    assert done.finish == "length" and span <= len(done.tokens) <= head + span + 2 * period
    assert len(done.tokens) < whole
    assert store.messages(conv)[-1].content == done.reply and done.reply.startswith("Paris.")
    # The cache holds the cut reply exactly: the next turn appends to it.
    nxt = list(session.turn(conv, "And of Korea?", sampled))[-1]
    u = done.usage
    assert nxt.usage.cached_tokens >= u.prompt_tokens + u.completion_tokens - 2
    # Negative controls: replies that repeat a phrase a few times run to their end, and a
    # greedy one (ask, batch: scripts) is left as the model wrote it.
    assert nxt.finish == "stop" and nxt.reply == after
    for text in (hellos, lines):
        turn = list(session.turn(conv, "Again?", sampled))
        assert turn[-1].finish == "stop" and turn[-1].reply == text
        assert not [e for e in turn if isinstance(e, Notice) and "repeated" in e.text]
    events = list(session.turn(session.conversation("greedy"), "Again?",
                               TurnOptions(max_tokens=1024)))
    assert events[-1].reply == LOOP and len(events[-1].tokens) == whole + 1  # (and its EOS)
    assert not [e for e in events if isinstance(e, Notice) and "repeated" in e.text]
