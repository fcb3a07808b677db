"""``localchat serve`` with images, through the official ``openai`` and ``anthropic`` clients,
on tiny random vision models (``tests/tinyvlm.py``): an image conversation's later turns hit
the cache (after a restart too), a resumed turn replies token for token as a cold server
does, a same-size swapped image misses from its first token on; bad images (not an image,
truncated, a decompression bomb, bad base64, a remote URL, an image for a text model) get a
400 naming the field and leave nothing stored.

Every request goes to 127.0.0.1, with timeouts.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serving import Server, post
from tinyvlm import build_tiny_vlm, random_image

from localchat.server import anthropic_api, openai_api
from localchat.server.chat import ApiError
from localchat.store.database import Store

FIRST = "What is in this picture?"
SECOND = "And what about its colours?"
THIRD = "Which part is the brightest?"
FIXED = "It is a small picture of coloured noise."  # a reply the client writes itself


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve-vlms")
    return {f: build_tiny_vlm(root / f, f) for f in ("qwen2_vl", "smolvlm", "gemma3")}


def png(w: int = 90, h: int = 60, seed: int = 0) -> bytes:
    out = io.BytesIO()
    random_image(w, h, seed).save(out, "PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def openai_user(text: str, data: bytes) -> dict:
    return {"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(data)}"}}]}


def anthropic_user(text: str, data: bytes) -> dict:
    return {"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": b64(data)}},
        {"type": "text", "text": text}]}


def start(home: Path, model: Path, started: list) -> Server:
    s = Server(home, model).start()
    started.append(s)
    return s


@pytest.fixture
def servers():
    """Servers started by a test (any home); all stopped at the end, none with a traceback."""
    started: list[Server] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.stop()
        assert "Traceback" not in s.err, s.err


def ask(s: Server, messages: list[dict], max_tokens: int = 8):
    return s.openai().chat.completions.create(model="localchat", messages=messages,
                                              max_tokens=max_tokens, temperature=0)


def image_start(home: Path, model: Path, conv_name_part: str) -> int:
    """Where the first image of the (one) conversation whose name holds ``conv_name_part``
    starts in its cache's token list: its first key above the vocabulary."""
    config = json.loads((model / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    store = Store.open(home / "localchat.db")
    try:
        (conv,) = [c for c in store.list() if conv_name_part in c.name]
    finally:
        store.close()
    tokens = json.loads((home / "kv" / str(conv.id) / "manifest.json").read_text())["tokens"]
    return next(i for i, t in enumerate(tokens) if t >= vocab)


# -- the cache through the clients --------------------------------------------------------


def test_openai_image_conversation_hits_the_cache_across_a_restart(vlms, servers, tmp_path):
    home = tmp_path / "home"
    s = start(home, vlms["qwen2_vl"], servers)
    history = [openai_user(FIRST, png())]
    one = ask(s, history)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": one.choices[0].message.content},
                {"role": "user", "content": SECOND}]
    text, usage = "", None
    for chunk in s.openai().chat.completions.create(
            model="localchat", messages=history, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert usage.prompt_tokens_details.cached_tokens >= (
        one.usage.prompt_tokens + one.usage.completion_tokens - 2)
    assert s.stop() == 0
    # After a restart: the image's K/V comes from disk (the original bytes are not re-read:
    # the request re-sends them, the cache is keyed by their content).
    s2 = start(home, vlms["qwen2_vl"], servers)
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": THIRD}]
    three = ask(s2, history)
    assert three.usage.prompt_tokens_details.cached_tokens >= (
        usage.prompt_tokens + usage.completion_tokens - 2)
    s2.stop()
    # One conversation, one stored image (0600), named by the first message.
    store = Store.open(home / "localchat.db")
    (conv,) = store.list()
    first = store.messages(conv)[0]
    store.close()
    assert len(first.extra["images"]) == 1
    (stored,) = (home / "images").iterdir()
    assert stored.name.startswith(first.extra["images"][0]) and stored.stat().st_mode & 0o77 == 0


def test_resumed_equals_a_cold_server_and_a_swapped_image_misses(vlms, servers, tmp_path):
    """A conversation whose prompt is the client's own (no reply re-tokenized): a turn
    resumed after a restart, a same-size swapped image and a text turn after it reply token
    for token as a fresh server with no cache does; the swap misses from its image on."""
    model, home = vlms["qwen2_vl"], tmp_path / "home"
    a, b = png(seed=0), png(seed=1)  # the same size, other pixels
    opening = [{"role": "user", "content": "Hello, I will show you a picture."},
               {"role": "assistant", "content": FIXED}]
    w = start(home, model, servers)
    x = ask(w, opening + [openai_user(FIRST, a)])
    assert x.usage.prompt_tokens_details.cached_tokens == 0
    w.stop()
    start_a = image_start(home, model, "hello")
    w = start(home, model, servers)
    same = ask(w, opening + [openai_user(FIRST, a)])  # asked again: all of it from disk
    assert same.usage.prompt_tokens_details.cached_tokens >= x.usage.prompt_tokens - 1
    assert same.choices[0].message.content == x.choices[0].message.content
    swap = ask(w, opening + [openai_user(FIRST, b)])
    # A miss from the swapped image's first token on, though its token ids are A's.
    assert swap.usage.prompt_tokens_details.cached_tokens == start_a
    assert swap.usage.prompt_tokens == x.usage.prompt_tokens
    after = opening + [openai_user(FIRST, b), {"role": "assistant", "content": FIXED},
                       {"role": "user", "content": SECOND}]
    text_turn = ask(w, after)
    assert text_turn.usage.prompt_tokens_details.cached_tokens > start_a
    w.stop()
    cold_swap, cold_text = (ask(c, messages) for c, messages in (
        (start(tmp_path / "cold-swap", model, servers), opening + [openai_user(FIRST, b)]),
        (start(tmp_path / "cold-text", model, servers), after)))
    assert cold_swap.usage.prompt_tokens_details.cached_tokens == 0
    assert cold_text.usage.prompt_tokens_details.cached_tokens == 0
    for warm, ref in ((swap, cold_swap), (text_turn, cold_text)):
        assert warm.choices[0].message.content == ref.choices[0].message.content
        assert warm.usage.completion_tokens == ref.usage.completion_tokens
    # The control: the model sees the image (a stale image's K/V would give A's reply).
    assert swap.choices[0].message.content != x.choices[0].message.content


@pytest.mark.parametrize("family", ["smolvlm", "gemma3"])
def test_anthropic_image_blocks_hit_the_cache(vlms, servers, tmp_path, family):
    """Each turn reads the last one's prompt (its image included) and reply from the cache.
    SmolVLM's template renders a stored reply after "Assistant: " while its generation
    prompt ends at "Assistant:" (as the real SmolVLM's does), so a random model's reply not
    opening with a space is re-rendered otherwise: there the hit ends at the reply."""
    home = tmp_path / "home"
    reply = (lambda u: 0) if family == "smolvlm" else (lambda u: u.output_tokens)
    s = start(home, vlms[family], servers)
    client = s.anthropic()
    greedy = {"temperature": 0}
    history = [anthropic_user(FIRST, png())]
    one = client.messages.create(model="localchat", max_tokens=8, extra_body=greedy,
                                 messages=history)
    u1 = one.usage
    assert u1.cache_read_input_tokens == 0 and u1.cache_creation_input_tokens > 0
    history += [{"role": "assistant", "content": one.content[0].text},
                {"role": "user", "content": SECOND}]
    with client.messages.stream(model="localchat", max_tokens=8, extra_body=greedy,
                                messages=history) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    u2 = final.usage
    assert u2.cache_read_input_tokens >= u1.cache_creation_input_tokens + reply(u1) - 2
    count = client.messages.count_tokens(model="localchat", messages=history)
    assert (u2.cache_read_input_tokens + u2.cache_creation_input_tokens + u2.input_tokens
            == count.input_tokens)
    assert s.stop() == 0
    s2 = start(home, vlms[family], servers)
    history += [{"role": "assistant", "content": streamed}, {"role": "user", "content": THIRD}]
    three = s2.anthropic().messages.create(model="localchat", max_tokens=8, extra_body=greedy,
                                           messages=history)
    assert three.usage.cache_read_input_tokens >= (
        u2.cache_read_input_tokens + u2.cache_creation_input_tokens + reply(u2) - 2)


# -- bad images ---------------------------------------------------------------------------


def bomb() -> bytes:
    """A small PNG that decodes to more pixels than Pillow's decompression-bomb limit."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (10_000, 9_000)).save(out, "PNG")  # 90 M pixels, a few KB
    return out.getvalue()


def openai_body(part: dict, role: str = "user") -> dict:
    return {"model": "localchat", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi."},
                         {"role": "assistant", "content": "Hello."} if role == "user" else
                         {"role": "assistant", "content": [part]},
                         {"role": "user", "content": [{"type": "text", "text": "Look."},
                                                      part] if role == "user" else "Look."}]}


def url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def block(data: str, media: str = "image/png", kind: str = "base64") -> dict:
    return {"type": "image", "source": {"type": kind, "media_type": media, "data": data}}


def anthropic_body(b: dict) -> dict:
    return {"model": "localchat", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Look."}, b]}]}


def test_bad_images_get_a_400_naming_the_field_and_nothing_is_stored(vlms, servers, tmp_path,
                                                                     kinds):
    home = tmp_path / "home"
    s = start(home, vlms["qwen2_vl"], servers)
    whole = png()
    cases = [
        (openai_body(url_part("data:image/png;base64," + b64(b"not an image at all"))),
         "messages[2].content[1].image_url.url", "not an image"),
        (openai_body(url_part("data:image/png;base64," + b64(whole[: len(whole) // 2]))),
         "messages[2].content[1].image_url.url", "truncated"),
        (openai_body(url_part("data:image/png;base64," + b64(bomb()))),
         "messages[2].content[1].image_url.url", "too large"),
        (openai_body(url_part("data:image/png;base64,@@@")),
         "messages[2].content[1].image_url.url", "base64"),
        (openai_body(url_part("https://example.com/cat.png")),
         "messages[2].content[1].image_url.url", "remote"),
        (openai_body(url_part("data:text/plain;base64," + b64(whole))),
         "messages[2].content[1].image_url.url", "data URL"),
        (openai_body(url_part("data:image/png;base64," + b64(whole)), role="assistant"),
         "messages[1].content[0]", "user messages only"),
    ]
    for body, field, words in cases:
        status, answer = post(f"{s.url}/v1/chat/completions", json.dumps(body))
        assert status == 400, answer
        assert answer["error"]["param"] == field and words in answer["error"]["message"], answer
    for b, field, words in [
            (block(b64(whole[:100])), "messages.0.content.1.source.data", "truncated"),
            (block(b64(bomb())), "messages.0.content.1.source.data", "too large"),
            (block("https://example.com/cat.png", kind="url"),
             "messages.0.content.1.source.type", "not fetched"),
            (block(b64(whole), media="text/plain"), "messages.0.content.1.source.media_type",
             "image/png")]:
        for route in ("/v1/messages", "/v1/messages/count_tokens"):
            body = anthropic_body(b)
            if route.endswith("count_tokens"):
                body = {k: v for k, v in body.items() if k in ("model", "messages")}
            status, answer = post(f"{s.url}{route}", json.dumps(body))
            assert status == 400 and answer["type"] == "error", answer
            assert words in answer["error"]["message"] and field in answer["error"]["message"]
    s.stop()
    assert not (home / "images").exists()
    store = Store.open(home / "localchat.db")
    assert store.list() == []
    store.close()
    # A text model: the image is refused before the request is queued, in either API.
    t = start(tmp_path / "text", kinds["llama"], servers)
    status, answer = post(f"{t.url}/v1/chat/completions",
                          json.dumps(openai_body(url_part("data:image/png;base64," + b64(whole)))))
    assert status == 400 and answer["error"]["param"] == "messages[2].content[1]"
    assert "text model" in answer["error"]["message"]
    status, answer = post(f"{t.url}/v1/messages", json.dumps(anthropic_body(block(b64(whole)))))
    assert status == 400 and "messages.0.content.1: " in answer["error"]["message"]
    assert "text model" in answer["error"]["message"]
    t.stop()
    assert not (tmp_path / "text" / "images").exists()
    store = Store.open(tmp_path / "text" / "localchat.db")
    assert store.list() == []
    store.close()


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=300) | st.builds(
    lambda cut: png(12, 9)[:cut], st.integers(0, 400)))
def test_generated_bytes_are_an_image_or_one_400(data):
    """Any bytes as an image part of either API: a request whose images decoded, or one
    400 naming the field (never another exception)."""
    for parse, body, field in (
            (openai_api.parse, openai_body(url_part("data:image/png;base64," + b64(data))),
             "messages[2].content[1].image_url.url"),
            (anthropic_api.parse, anthropic_body(block(b64(data))),
             "messages.0.content.1.source.data")):
        try:
            req = parse(body)
        except ApiError as err:
            assert err.status == 400 and err.param == field and err.message.startswith(field)
            continue
        (image,) = req.images
        assert image.info.width >= 1 and req.messages[-1]["images"] == [image.digest]


def test_chains_cover_images_and_older_databases_are_rechained(tmp_path):
    """A message's chain holds its images' hashes (a request with another image is another
    conversation); a database whose image messages were chained without them (before schema
    12) is rechained when it opens, so no request continues it by its text alone."""
    import sqlite3

    from localchat.store.migrations import (
        IMAGES_CHAINED,
        MIGRATIONS,
        chain_seed,
        message_chain,
        statements,
    )

    a, b = "a" * 64, "b" * 64
    seed = chain_seed(None)
    assert message_chain(seed, "user", "Look.", {"images": [a]}) != message_chain(
        seed, "user", "Look.", {"images": [b]})
    assert message_chain(seed, "user", "Look.", {"images": [a]}) != message_chain(
        seed, "user", "Look.")
    path = tmp_path / "old.db"
    db = sqlite3.connect(path, isolation_level=None)
    for i, sql in enumerate(MIGRATIONS[:IMAGES_CHAINED - 1]):
        for statement in statements(sql):
            db.execute(statement)
        db.execute(f"PRAGMA user_version = {i + 1}")
    db.execute("INSERT INTO conversations (name, model, created, updated) VALUES "
               "('pics', 'm', 0, 0)")
    old = message_chain(seed, "user", "Look.")  # as schema 12 chained it: no images
    db.execute("INSERT INTO messages (conversation_id, seq, role, content, created, chain, "
               "extra) VALUES (1, 1, 'user', 'Look.', 0, ?, ?)",
               (old, json.dumps({"images": [a]})))
    db.execute("INSERT INTO messages (conversation_id, seq, role, content, created, chain) "
               "VALUES (1, 2, 'assistant', 'Noise.', 0, ?)",
               (message_chain(old, "assistant", "Noise."),))
    db.close()
    store = Store.open(path)
    (conv,) = store.list()
    # Found by its text and image, not by its text alone.
    assert [c.name for c, _ in store.continued_by(None, [("user", "Look.", {"images": [a]})],
                                                  "m")] == ["pics"]
    assert store.continued_by(None, [("user", "Look.", {})], "m") == []
    assert store.image_users(a) == 1 and store.image_users(b) == 0
    store.close()
