"""A conversation with images resumes exactly (``model/vision.py``): on tiny random Qwen2-VL,
SmolVLM and Gemma 3, a turn resumed from the cache gives token for token the reply of a cold
turn (``no_cache``: a full prefill) for a text turn after an image, a new image, an image
swapped for another of the same size, a transposed image, and after a restart (the cache
read back from disk). The control: image tokens keyed by their ids alone (no image hash)
reuse the stale K/V of a swapped image, and the reply is the old image's."""

from __future__ import annotations

from pathlib import Path

import pytest
from tinyvlm import FAMILIES, build_tiny_vlm, random_image

from localchat.events import TurnFinished
from localchat.session.generation import TurnOptions

OPTS = TurnOptions(max_tokens=8)
COLD = TurnOptions(max_tokens=8, no_cache=True)


def picture(path: Path, w: int = 90, h: int = 60, seed: int = 0, transpose: bool = False):
    from PIL import Image

    image = random_image(w, h, seed)
    (image.transpose(Image.Transpose.TRANSPOSE) if transpose else image).save(path)
    return path


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from localchat.model.loading import load_engine

    root = tmp_path_factory.mktemp("vlm")
    return {f: load_engine(str(build_tiny_vlm(root / f, f))) for f in FAMILIES}


def open_session(engine):
    from localchat import paths
    from localchat.session.session import Session
    from localchat.store.database import Store

    return Session(Store.open(paths.database_path()), engine, paths.kv_root(),
                   paths.locks_dir())


def finish(events) -> TurnFinished:
    return [e for e in events if isinstance(e, TurnFinished)][-1]


# A system prompt long enough for another conversation to share the prefix before an image
# (``kvcache.sharing.MIN_SHARED``).
SYSTEM = "You describe pictures. " * 12


def run(session, name: str, prompt: str, images=(), options=OPTS) -> TurnFinished:
    conv = session.conversation(name, system=SYSTEM)
    return finish(session.turn(conv, prompt, options, images=tuple(images)))


def stored(tmp_path, **kw) -> str:
    from localchat import paths
    from localchat.store.images import ImageStore

    name = "-".join(f"{k}{v}" for k, v in kw.items()) or "img"
    return ImageStore(paths.images_dir()).add(picture(tmp_path / f"{name}.png", **kw)).digest


def twins(session, history: list[tuple[str, tuple[str, ...]]], last: tuple[str, tuple]):
    """Conversation "warm" runs ``history`` then ``last`` (resuming from its cache: the
    case), conversation "cold" the same with every turn a full prefill; both last turns."""
    for name in ("warm", "cold"):
        for prompt, images in history:
            run(session, name, prompt, images, OPTS if name == "warm" else COLD)
    warm = run(session, "warm", *last)
    cold = run(session, "cold", *last, options=COLD)
    return warm, cold


def swapped(session, a: str, b: str) -> tuple[TurnFinished, TurnFinished]:
    """Conversation "a": a text turn, then image ``a``; its fork after the text turn then
    sends image ``b`` in the same place. Both image turns."""
    run(session, "a", "Hello.")
    first = run(session, "a", "What is it?", (a,))
    fork, _ = session.fork(session.conversation("a"), "warm", at=2)
    return first, finish(session.turn(fork, "What is it?", OPTS, images=(b,)))


CASES = ["text after an image", "a new image", "a same-size swap", "a transposed image"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", CASES)
def test_resumed_equals_cold(engines, home, tmp_path, family, case):
    session = open_session(engines[family])
    a = stored(tmp_path, seed=0)
    if case == "text after an image":
        warm, cold = twins(session, [("What is it?", (a,))], ("And the colours?", ()))
        assert warm.usage.cached_tokens > 0.5 * warm.usage.prompt_tokens
    elif case == "a new image":
        b = stored(tmp_path, seed=1, w=60, h=60)
        warm, cold = twins(session, [("What is it?", (a,))], ("And this one?", (b,)))
        assert warm.usage.cached_tokens > 0
    else:
        # Conversation "a" holds image a in its cache; its fork after the first turn sends
        # the same text with the other image in the same place, resuming from a's cache
        # (shared files), which must stop at the image's first token (with a sliding window:
        # at the checkpoint before it, the end of the first turn).
        other = stored(tmp_path, seed=1) if case == "a same-size swap" else \
            stored(tmp_path, seed=0, transpose=True)
        assert other != a
        warm0, warm = swapped(session, a, other)
        run(session, "cold", "Hello.", options=COLD)
        cold = run(session, "cold", "What is it?", (other,), COLD)
        assert warm.usage.cached_tokens < warm0.usage.prompt_tokens  # stopped at the image
        assert warm.usage.cached_tokens > 0
    assert warm.tokens == cold.tokens
    assert warm.usage.cached_tokens > 0 and cold.usage.cached_tokens == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_resumed_after_a_restart_equals_cold(engines, home, tmp_path, family):
    """A new session (the cache read back from the disk, the vision features computed
    again) continues an image conversation as a cold turn does."""
    engine = engines[family]
    a = stored(tmp_path, seed=0)
    first = open_session(engine)
    before = run(first, "warm", "What is it?", (a,))
    run(first, "cold", "What is it?", (a,), COLD)
    first.close()
    engine.memo.clear()
    engine.keys.clear()
    again = open_session(engine)
    warm = run(again, "warm", "Tell me more.")
    cold = run(again, "cold", "Tell me more.", options=COLD)
    # The whole first prompt, its image included, came from the disk (the random model's
    # reply of broken UTF-8 may render back otherwise: that part may be prefilled again).
    assert warm.usage.cached_tokens >= before.usage.prompt_tokens
    assert warm.tokens == cold.tokens


# (Gemma 3's sliding-window layer resumes only at a checkpoint: a fork's turn resumes at the
# end of the turn before the image whatever the keys say, so the stale case cannot arise.)
@pytest.mark.parametrize("family", ["qwen2_vl", "smolvlm"])
def test_keys_without_the_image_hash_reuse_a_swapped_images_cache(engines, home, tmp_path,
                                                                   monkeypatch, family):
    """The negative control: keyed by index alone, a same-size swap matches the whole
    prompt, and the reply is the stale image's — not the cold reply for the new image."""
    from localchat.model import vision

    engine = engines[family]
    session = open_session(engine)
    a, b = stored(tmp_path, seed=0), stored(tmp_path, seed=1)
    run(session, "cold-a", "Hello.", options=COLD)
    cold_a = run(session, "cold-a", "What is it?", (a,), COLD)
    run(session, "cold-b", "Hello.", options=COLD)
    cold_b = run(session, "cold-b", "What is it?", (b,), COLD)
    assert cold_a.tokens != cold_b.tokens  # the model sees the image
    real = vision.image_key
    monkeypatch.setattr(vision, "image_key",
                        lambda salt, digest, j, vocab: real(salt, "same", j, vocab))
    _, stale = swapped(session, a, b)
    assert stale.usage.cached_tokens >= stale.usage.prompt_tokens - 1  # all of it "hit"
    assert stale.tokens != cold_b.tokens
    assert stale.tokens == cold_a.tokens


def test_an_image_for_a_text_model_is_refused_before_anything_is_stored(session, home,
                                                                         tmp_path):
    from localchat.errors import BadInput

    a = stored(tmp_path, seed=0)
    conv = session.conversation("text")
    with pytest.raises(BadInput, match="is a text model: it cannot take images"):
        list(session.turn(conv, "What is it?", OPTS, images=(a,)))
    assert session.store.messages(conv) == []
