"""Every cache class mlx-lm has, resumed from disk: growing segments and bounded checkpoints.

One tiny random model per family (``families.py``): plain KV (llama, qwen3), MLA (deepseek
v3: latent keys and rope values of different widths), sliding windows (gemma3, gpt-oss),
chunked attention (llama4), linear attention / conv / SSM state (qwen3-next, lfm2, mamba2)
and CacheLists (falcon-h1, baichuan-m1, deepseek v3.2). Each check compares a conversation
resumed from disk, turn after turn, with a twin whose every turn is a full prefill.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from families import FAMILIES, build_family
from twins import full_prefill

from localchat import paths
from localchat.events import Notice, TurnFinished
from localchat.kvcache.folder import KEEP_CHECKPOINTS
from localchat.model.engine import Engine
from localchat.session.session import Session, TurnOptions

PROMPTS = ["Hello there, how are you today? Tell me about Seoul.",
           "What is the capital of France?", "And Korea? 안녕하세요",
           "Thanks, tell me more about caches please."]
BOUNDED = ["gemma3_text", "gpt_oss", "llama4", "qwen3_next", "lfm2", "mamba2", "falcon_h1",
           "baichuan_m1"]
HELPER = str(Path(__file__).parents[1] / "crash_helper.py")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    made: dict[str, tuple[Path, Engine]] = {}

    def get(name: str) -> tuple[Path, Engine]:
        if name not in made:
            folder = build_family(name, tmp_path_factory.mktemp(name) / name)
            made[name] = (folder, Engine.load(str(folder)))
        return made[name]
    return get


def turn(store, engine, conv, prompt=None, how="turn", **kw) -> tuple[TurnFinished, list]:
    """One turn in a fresh Session: nothing in memory, the cache comes from disk."""
    session = Session(store, engine, paths.kv_root(), paths.locks_dir())
    options = TurnOptions(**{"max_tokens": 16, **kw})
    if how == "regenerate":
        events = list(session.regenerate(conv, options))
    elif how == "edit":
        events = list(session.edit_last(conv, prompt, options))
    else:
        events = list(session.turn(conv, prompt, options))
    return events[-1], [e.text for e in events if isinstance(e, Notice)]


def test_the_families_cover_every_cache_class(built):
    from mlx_lm.models import cache as mlx_cache

    seen = set()
    for name in FAMILIES:
        _, engine = built(name)
        for c in mlx_cache.make_prompt_cache(engine.model):
            seen.add(type(c).__name__)
            seen.update(type(p).__name__ for p in getattr(c, "caches", ()))
    assert {"KVCache", "RotatingKVCache", "ArraysCache", "ChunkedKVCache", "CacheList"} <= seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_four_turns_from_disk_equal_full_prefills(home, store, built, family):
    _, engine = built(family)
    info = engine.info()
    resumed, twin = store.create("r", engine.ref.name), store.create("t", engine.ref.name)
    previous = None
    replies = []
    for i, prompt in enumerate(PROMPTS):
        got, notes = turn(store, engine, resumed, prompt)
        ref, _ = turn(store, engine, twin, prompt, no_cache=True)
        # A reply is at least 4 tokens unless the model ended it (a random model may write
        # an end-of-document token early: baichuan_m1's second reply is 2 tokens and its end).
        assert ref.usage.cached_tokens == 0 and (len(ref.tokens) >= 4 or ref.finish == "stop")
        assert got.tokens == ref.tokens, f"turn {i + 1}"
        replies.append(got.tokens)
        if previous is not None:
            assert notes == [] and got.usage.miss_reason == ""
            u = previous.usage
            assert got.usage.cached_tokens >= u.prompt_tokens + u.completion_tokens - 2
        previous = got
    # Negative control: the model's replies depend on the conversation.
    assert len(set(replies)) == len(replies)
    # Disk: growing layers per token, plus a few checkpoints whose size does not grow.
    folder = paths.kv_root() / str(resumed.id)
    man = json.loads((folder / "manifest.json").read_text())
    segs = sum(s["nbytes"] for s in man["segments"])
    ckpts = sum(c["nbytes"] for c in man["checkpoints"])
    assert segs <= 1.05 * len(man["tokens"]) * info.kv_bytes_per_token + 2048 * len(
        man["segments"])
    assert len(man["checkpoints"]) <= KEEP_CHECKPOINTS
    assert ckpts <= len(man["checkpoints"]) * (info.state_bytes + 4096)
    assert (not man["checkpoints"]) == info.cut_anywhere


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", *BOUNDED])
def test_regenerate_and_edit_resume_before_the_changed_message(home, store, built, family):
    _, engine = built(family)
    conv = store.create("e", engine.ref.name)
    first, _ = turn(store, engine, conv, PROMPTS[0])
    second, _ = turn(store, engine, conv, PROMPTS[1])
    again, notes = turn(store, engine, conv, how="regenerate")
    assert notes == [] and again.usage.miss_reason == "regenerated"
    # The prompt's checkpoint sits one token before the reply: only that token is fed.
    assert again.usage.cached_tokens == second.usage.prompt_tokens - 1
    edited, notes = turn(store, engine, conv, "And Busan?", how="edit")
    assert notes == [] and edited.usage.miss_reason.startswith("edited")
    assert edited.usage.cached_tokens >= first.usage.context_tokens
    twin = store.create("e-twin", engine.ref.name)
    for prompt in (PROMPTS[0], "And Busan?"):
        ref, _ = turn(store, engine, twin, prompt, no_cache=True)
    assert ref.tokens == edited.tokens


def test_sigkill_while_a_checkpoint_is_written_leaves_an_older_one(home, store, built):
    folder, engine = built("gemma3_text")
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}

    def ask(prompt, mode=None):
        args = ["ask", "-m", str(folder), "-c", "k", "--max-tokens", "16", "--json", prompt]
        cmd = [sys.executable, HELPER, mode, "--", *args] if mode else \
            [sys.executable, "-m", "localchat", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    first = ask(PROMPTS[0])
    assert first.returncode == 0, first.stderr
    killed = ask(PROMPTS[1], mode="kill-checkpoint")
    assert killed.returncode == -signal.SIGKILL
    conv = store.get("k")
    before = store.messages(conv)
    assert [m.role for m in before] == ["user", "assistant", "user", "assistant"]
    manifest = (paths.kv_root() / str(conv.id) / "manifest.json").read_text()
    got, notes = turn(store, engine, conv, PROMPTS[2])
    # The first turn's checkpoints and segments are intact: resumed from there, no notice.
    assert notes == []
    assert got.usage.cached_tokens >= json.loads(first.stdout)["usage"]["prompt_tokens"]
    ref = full_prefill(store, engine, conv, PROMPTS[2], before, manifest, max_tokens=16)
    assert len(ref.tokens) >= 4 and got.tokens == ref.tokens


def test_a_cache_class_localchat_does_not_know_still_answers(home, store, built, monkeypatch):
    from mlx_lm.models import cache as mlx_cache
    from mlx_lm.models import llama

    class NewCache(mlx_cache.KVCache):
        """What a future mlx-lm release might add."""

    folder, _ = built("llama")
    monkeypatch.setattr(llama.Model, "make_cache",
                        lambda self: [NewCache() for _ in self.layers], raising=False)
    engine = Engine.load(str(folder))
    assert len(engine.notices) == 1 and "NewCache" in engine.notices[0]
    conv = store.create("u", engine.ref.name)
    for prompt in PROMPTS[:2]:
        got, notes = turn(store, engine, conv, prompt)
        assert got.usage.cached_tokens == 0 and len(got.tokens) >= 4
    folder = paths.kv_root() / str(conv.id)
    assert not folder.exists() or not any(folder.iterdir())
    assert engine.info().unknown == ("NewCache",)
