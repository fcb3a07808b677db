"""Reasoning models: thinking kept apart from the answer, switched on and off, and cached
through a template that drops it from earlier turns (``families.THINKING``, Qwen3's way).

The tiny models have ``<think>``/``</think>`` tokens; random weights would never close a
thought, so a sampler forces the markers at fixed steps and is greedy between them (never
choosing a marker or the end of text there). Cached and ``--no-cache`` runs are forced the same
way, so their replies must still be equal token for token.
"""

import json
import sqlite3

import pytest
from families import build_family
from hypothesis import given, settings
from hypothesis import strategies as st

from localchat import paths
from localchat.events import Notice, TurnFinished
from localchat.model.engine import Engine
from localchat.model.replies import HARMONY, ReasoningStream, split_reasoning
from localchat.session.session import Session, TurnOptions
from localchat.store.database import Store
from localchat.store.migrations import MIGRATIONS, statements

PROMPTS = ["Hello there, how are you today? Tell me about Seoul.",
           "What is the capital of France?", "And Korea? 안녕하세요",
           "Thanks, tell me more about caches please."]
THINK_STEPS = 5  # forced: <think> (unless the prompt opened it), then 4 greedy, then </think>


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    made: dict[tuple[str, str], Engine] = {}

    def get(name: str, template: str = "closed") -> Engine:
        if (name, template) not in made:
            folder = build_family(name, tmp_path_factory.mktemp(name) / name, thinking=template)
            made[name, template] = Engine.load(str(folder))
        return made[name, template]
    return get


@pytest.fixture
def forced(monkeypatch):
    """Make every decode think for a few tokens first: ``forced(engine, opens)``;
    ``forced(engine, on=False)``: mlx-lm's own sampler again."""
    import mlx.core as mx
    import mlx_lm.sample_utils as su

    original = su.make_sampler

    def force(engine: Engine, opens: bool = False, on: bool = True) -> None:
        if not on:
            monkeypatch.setattr(su, "make_sampler", original)
            return
        vocab = engine.tokenizer.get_vocab()
        start, end = vocab["<think>"], vocab["</think>"]
        banned = [start, end, *engine.eos_ids]

        def make_sampler(temp, top_p=0.0, **_):
            step = iter(range(1 << 30))

            def sample(logits):
                n = next(step)
                rows = logits.shape[0]  # (batch --parallel decodes several together)
                if n == 0 and not opens:
                    return mx.full((rows,), start)
                if n == THINK_STEPS:
                    return mx.full((rows,), end)
                masked = logits
                if n < THINK_STEPS + 3:  # no end of text while it thinks, nor just after
                    masked = logits.at[..., banned].add(-1e9)
                else:
                    masked = logits.at[..., [start, end]].add(-1e9)
                return mx.argmax(masked, axis=-1)
            return sample
        monkeypatch.setattr(su, "make_sampler", make_sampler)
    return force


def turn(store, engine, conv, prompt, **kw) -> tuple[TurnFinished, list]:
    """One turn in a fresh Session: nothing in memory, the cache comes from disk."""
    session = Session(store, engine, paths.kv_root(), paths.locks_dir())
    events = list(session.turn(conv, prompt, TurnOptions(**{"max_tokens": 16, **kw})))
    return events[-1], [e.text for e in events if isinstance(e, Notice)]


def reply_start(engine, tokens: list[int], prompt_tokens: int) -> int:
    """Where the previous reply starts in the cache's tokens: after its prompt, or at the
    thinking marker the template put at the prompt's end."""
    think = engine.tokenizer.get_vocab()["<think>"]
    tail = [i for i in range(max(0, prompt_tokens - 8), prompt_tokens) if tokens[i] == think]
    return tail[-1] if tail else prompt_tokens


@pytest.mark.parametrize("family,template,thinking", [
    ("llama", "closed", None),  # growing: cut anywhere
    ("gemma3_text", "closed", None),  # sliding window: a checkpoint at the reply's start
    ("qwen3_next", "closed", None),  # recurrent + attention
    ("gemma3_text", "opens", None),  # the prompt opens <think>: the checkpoint goes before it
    ("qwen3_next", "opens", None),
    ("qwen3_next", "closed", False),  # thinking off: an empty block the re-render drops
    ("llama", "closed", False),
    # Every other cache class and family: MLA, sliding window + sinks, chunked, recurrent,
    # CacheLists (families.py says which family holds which).
    *[(f, "closed", None) for f in ("qwen3", "deepseek_v3", "gpt_oss", "llama4", "lfm2",
                                    "mamba2", "falcon_h1", "baichuan_m1", "deepseek_v32")],
])
def test_turns_resume_at_the_previous_reply_and_equal_full_prefills(
        home, store, built, forced, family, template, thinking):
    engine = built(family, template)
    if thinking is not False:
        forced(engine, opens=template == "opens")
    resumed, twin = store.create("r", engine.ref.name), store.create("t", engine.ref.name)
    previous, answers, fed = None, [], []
    for i, prompt in enumerate(PROMPTS):
        got, notes = turn(store, engine, resumed, prompt, thinking=thinking)
        ref, _ = turn(store, engine, twin, prompt, thinking=thinking, no_cache=True)
        assert ref.usage.cached_tokens == 0
        assert got.tokens == ref.tokens, f"turn {i + 1}"
        assert (got.reasoning, got.reply) == (ref.reasoning, ref.reply)
        assert "<think>" not in got.reply and "</think>" not in got.reply
        if thinking is False:
            assert got.reasoning == "" and got.usage.reasoning_tokens == 0
        else:
            # the thinking's tokens, its markers included: steps 0-5 (step 0 is <think>, or
            # the first thought when the prompt opened it)
            assert got.reasoning and got.usage.reasoning_tokens == THINK_STEPS + 1
        stored = store.messages(resumed)[-1]
        assert stored.content == got.reply
        assert (stored.extra or {}).get("reasoning_content", "") == got.reasoning
        if previous is not None:
            assert notes == []
            at = reply_start(engine, fed, previous.usage.prompt_tokens)
            assert got.usage.cached_tokens >= at, (got.usage, at)
            # ... and no more than the template kept: the reply's thinking is gone.
            assert got.usage.cached_tokens <= at + (template == "opens") * 2
            assert got.usage.miss_reason.startswith("re-rendered: ")
            if thinking is not False:
                assert "earlier reasoning dropped by the template" in got.usage.miss_reason
        folder = paths.kv_root() / str(resumed.id)
        fed = json.loads((folder / "manifest.json").read_text())["tokens"]
        previous = got
        answers.append(got.tokens)
    assert len(set(answers)) == len(answers)  # negative control: replies depend on the turn


def test_the_thinking_switch_is_the_conversations_and_renders_the_template(
        home, store, built, forced):
    engine = built("llama")
    session = Session(store, engine, paths.kv_root(), paths.locks_dir())
    conv = session.conversation("s", thinking=False)
    assert store.get("s").thinking is False and engine.thinking_switch
    off = list(session.turn(conv, PROMPTS[0], TurnOptions(max_tokens=8)))[-1]
    conv = session.conversation("s")  # None keeps the setting
    assert conv.thinking is False
    fed = json.loads((paths.kv_root() / str(conv.id) / "manifest.json").read_text())["tokens"]
    assert engine.decode_text(fed[:off.usage.prompt_tokens]).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    history = session.conversations.history(conv) + [{"role": "user", "content": "hi"}]
    assert engine.decode_text(engine.render(history, thinking=True)).endswith(
        "<|im_start|>assistant\n")
    forced(engine, opens=False)
    conv = session.conversation("s", thinking=True)
    on = list(session.turn(conv, PROMPTS[1], TurnOptions(max_tokens=12)))[-1]
    assert store.get("s").thinking is True
    assert off.usage.reasoning_tokens == 0 and on.usage.reasoning_tokens == THINK_STEPS + 1
    fork, _ = session.conversations.fork(conv, "s2")
    assert fork.thinking is True and store.get("s2").thinking is True


def test_an_old_database_migrates_its_replies_unchanged(tmp_path):
    """A database from before the thinking switch: the column is added, replies (raw
    markers included, as older versions stored them) are left as they were."""
    path = tmp_path / "old.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA foreign_keys=ON")
    before = next(i for i, sql in enumerate(MIGRATIONS) if "thinking" in sql)
    for i, sql in enumerate(MIGRATIONS[:before]):
        for statement in statements(sql):
            db.execute(statement)
        db.execute(f"PRAGMA user_version = {i + 1}")
    db.execute("INSERT INTO conversations (name, model, created, updated) VALUES "
               "('old', 'm', 0, 0)")
    old = "<think>\nhmm\n</think>\n\nParis."
    db.execute("INSERT INTO messages (conversation_id, seq, role, content, created) VALUES "
               "(1, 1, 'assistant', ?, 0)", (old,))
    db.close()
    store = Store.open(path)
    conv = store.get("old")
    assert conv.thinking is None
    assert [m.content for m in store.messages(conv)] == [old]
    store.close()


MARKERS = [("<think>", "</think>"), ("<|channel>thought", "<channel|>"), HARMONY]
WORDS = st.sampled_from(["생각", "think", "<", "</", ">", "\n", " ", "<think", "answer", "|",
                         "<|channel>", "thought", "<|end|>", "[/b]", "\x1b[31m"])


@settings(deadline=None)  # (a loaded machine's pause is no failure of the property)
@given(st.sampled_from(MARKERS), st.lists(WORDS, max_size=8), st.lists(WORDS, max_size=8),
       st.booleans(), st.booleans(), st.lists(st.integers(1, 6), min_size=1, max_size=40))
def test_a_streamed_reply_sorts_into_reasoning_and_answer_as_the_whole_does(
        markers, thought, answer, opened, closed, cuts):
    """However the text arrives in pieces, the stream gives what ``split_reasoning`` gives
    for the whole reply (up to the spaces around each part)."""
    start, end = markers
    thought, answer = "".join(thought), "".join(answer)
    if start in thought + answer or end in thought + answer or not closed:
        answer = ""  # (a marker inside the text, or a thought never closed, is all thought)
    whole = ("" if opened else start) + "\n" + thought + ((end + "\n\n" + answer)
                                                        if closed else "")
    stream, got_r, got_a, at = ReasoningStream(markers, inside=opened), "", "", 0
    for n in cuts + [len(whole)]:
        r, a = stream.add(whole[at:at + n])
        got_r, got_a, at = got_r + r, got_a + a, at + n
    r, a = stream.end()
    want = split_reasoning(markers, (start if opened else "") + whole)
    assert (got_r + r).strip() == want[0] and (got_a + a).strip() == want[1].strip()


def test_split_reasoning_of_plain_and_cut_replies():
    m = ("<think>", "</think>")
    assert split_reasoning(None, "<think>x</think>y") == ("", "<think>x</think>y")
    assert split_reasoning(m, "Just an answer.") == ("", "Just an answer.")
    assert split_reasoning(m, "<think>\nstill thinking") == ("still thinking", "")
    assert split_reasoning(m, "<think>\nhmm\n</think>\n\nParis.") == ("hmm", "Paris.")
    assert split_reasoning(HARMONY, HARMONY[0] + "the user asks" + HARMONY[1] + "Paris.") == (
        "the user asks", "Paris.")


def test_ask_batch_show_and_export_keep_the_reasoning_apart(
        home, built, forced, capsys, tmp_path):
    from localchat.cli.main import main

    engine = built("llama")
    folder = str(engine.ref.path)
    forced(engine, opens=False)
    assert main(["ask", "-m", folder, "-c", "r", "--max-tokens", "12", "--json", "Hello"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reasoning"] and "<think>" not in out["reply"] + out["reasoning"]
    assert out["usage"]["reasoning_tokens"] == THINK_STEPS + 1
    # Plain ask prints the answer only; --show-thinking puts the thinking first.
    assert main(["ask", "-m", folder, "-c", "q", "--max-tokens", "12", "Hello"]) == 0
    plain = capsys.readouterr().out
    assert main(["ask", "-m", folder, "-c", "q2", "--max-tokens", "12", "--show-thinking",
                 "Hello"]) == 0
    shown = capsys.readouterr().out
    assert out["reasoning"] not in plain and plain.strip() == out["reply"].strip()
    assert shown.startswith(out["reasoning"]) and shown.rstrip().endswith(out["reply"].strip())

    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"id": 1, "prompt": "Hello"}) + "\n"
                     + json.dumps({"id": 2, "conversation": "r", "prompt": "More"}) + "\n")
    assert main(["batch", str(lines), "-m", folder, "--max-tokens", "12", "--quiet"]) == 0
    results = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert results[0]["reasoning"] == out["reasoning"] and results[0]["reply"] == out["reply"]
    assert results[1]["reasoning"] and "<think>" not in results[1]["reply"]
    two = tmp_path / "two.jsonl"
    two.write_text(json.dumps({"id": 1, "prompt": "Hello"}) + "\n"
                   + json.dumps({"id": 2, "prompt": "Hello there"}) + "\n")
    assert main(["batch", str(two), "-m", folder, "--max-tokens", "12", "--quiet",
                 "--parallel", "2"]) == 0
    both = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert all(r["reasoning"] and "<think>" not in r["reply"] + r["reasoning"] for r in both)
    assert both[0]["usage"]["reasoning_tokens"] == THINK_STEPS + 1
    forced(engine, on=False)  # (a model told not to think does not open a thought)
    assert main(["batch", str(lines), "-m", folder, "--max-tokens", "12", "--quiet",
                 "--thinking", "off"]) == 0
    off = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert "reasoning" not in off[0] and "reasoning" not in off[1]
    assert off[0]["usage"]["prompt_tokens"] > results[0]["usage"]["prompt_tokens"]  # its block
    store = Store.open(paths.database_path())
    assert store.get("r").thinking is False  # a conversation line keeps the batch's switch
    store.close()

    assert main(["show", "q", "--json"]) == 0
    stored = json.loads(capsys.readouterr().out)["messages"][-1]
    assert stored["reasoning_content"] == out["reasoning"]
    assert main(["show", "q", "--show-thinking"]) == 0
    assert f"[assistant · thinking] {out['reasoning']}" in capsys.readouterr().out
    assert main(["show", "q"]) == 0
    assert out["reasoning"] not in capsys.readouterr().out
    assert main(["export", "q"]) == 0
    md = capsys.readouterr().out
    assert "<details><summary>Thinking</summary>" in md and out["reasoning"] in md
    assert main(["export", "q", "--no-thinking"]) == 0
    assert out["reasoning"] not in capsys.readouterr().out
    assert main(["export", "q", "--format", "json", "--no-thinking"]) == 0
    assert "reasoning_content" not in capsys.readouterr().out


async def test_the_app_folds_the_thinking_above_the_answer_and_switches_it(home, built):
    from fakes import ScriptedEngine
    from test_tui import replies, settle, status_text, type_and_send

    from localchat.tui.app import LocalchatApp
    from localchat.tui.chatview import ChatView, ThinkingBlock
    from localchat.tui.composer import Composer

    engine = built("llama")
    scripted = ScriptedEngine(engine, ["<think>\nThe user asks [/b] about France.\n</think>"
                                       "\n\nParis is the capital.", "No thinking here."])
    app = LocalchatApp(load_engine=lambda name, progress: scripted)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "What is the capital of France?")
        await settle(app, pilot)
        block = app.query_one(ThinkingBlock)
        assert block.collapsed and block.text == "The user asks [/b] about France."
        assert block.title.startswith("Thought for ") and block.title.endswith(" tokens")
        assert replies(app) == ["Paris is the capital."]  # the answer alone, below it
        chat = app.query_one(ChatView)
        assert chat.children.index(block) == chat.children.index(
            app.query("AssistantMessage").last()) - 1
        assert "(thinking " in status_text(app)
        await pilot.click(block._title.__class__)  # click unfolds, Enter folds again
        await pilot.pause()
        assert not block.collapsed
        block._title.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert block.collapsed
        stored = app.store.messages(app.current)[-1]
        assert stored.content == "Paris is the capital."
        assert stored.extra["reasoning_content"] == block.text
        # The fold drawn from storage holds what is stored (its figure was dropped).
        assert block.seconds == stored.extra["thinking_seconds"]
        # The palette's switch: stored on the conversation, and the next turn renders it.
        app.action_toggle_thinking()
        assert app.store.get(app.current.name).thinking is False
        app.query_one(Composer).focus()
        await type_and_send(pilot, "And Korea?")
        await settle(app, pilot)
        fed = json.loads((paths.kv_root() / str(app.current.id) / "manifest.json"
                          ).read_text())["tokens"]
        assert "<|im_start|>assistant\n<think>\n\n</think>\n\nNo thinking here." in \
            engine.decode_text(fed)
        assert len(app.query(ThinkingBlock)) == 1
        # Opened again later: the stored thinking is drawn folded.
        chat.show(app.store.messages(app.current))
        await pilot.pause()
        again = app.query(ThinkingBlock)
        assert len(again) == 1 and again.first().collapsed
        assert again.first().title == block.title  # what it took is kept with the reply


@pytest.mark.parametrize("template", ["closed", "opens"])
def test_a_constrained_reply_thinks_freely_then_answers_in_its_shape(home, store, built,
                                                                     forced, template):
    """The thinking is free text (opened by the prompt, or by the model's first token); the
    grammar holds the answer after ``</think>``; the next turn resumes as usual. Without the
    gate the constraint would refuse ``<think>`` as the first token (control below)."""
    import re

    from localchat.model.constraint import Matcher, parse_spec, tokenizer_for

    engine = built("qwen3", template)
    forced(engine, opens=template == "opens")
    shape = parse_spec("regex", "(yes|no|maybe)( [a-z]{2,6}){0,3}")
    conv = store.create("c", engine.ref.name)
    got, _ = turn(store, engine, conv, PROMPTS[0], max_tokens=40, constraint=shape)
    assert got.reasoning and got.usage.reasoning_tokens == THINK_STEPS + 1
    assert got.complete and re.fullmatch("(yes|no|maybe)( [a-z]{2,6}){0,3}", got.reply)
    again, _ = turn(store, engine, conv, PROMPTS[1], max_tokens=8)
    assert again.usage.cached_tokens > 0 and again.complete is None
    if template == "closed":  # control: the grammar alone refuses <think> at the first token
        vocab = engine.tokenizer.get_vocab()
        m = Matcher(shape, tokenizer_for(engine.tokenizer, engine.eos_ids))
        assert m.validate([vocab["<think>"]]) == 0
