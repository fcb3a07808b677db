"""Quantized KV caches (8 and 4 bits): stored once, resumed exactly, gated on quality."""

import json
import os
import subprocess
import sys

import pytest
from tiny import build_tiny_model
from twins import run_turn

from localchat import paths
from localchat.errors import BadInput
from localchat.kvcache import quality as kvquality
from localchat.kvcache.folder import CacheFolder
from localchat.model.engine import Engine
from localchat.session.session import Session

PROMPTS = ["Hello there, how are you today? Tell me about Seoul.",
           "What is the capital of France?", "And Korea? 안녕하세요",
           "Thanks, tell me more about caches please."]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Head dim 32, so groups of 32 fit; one sliding layer and one global."""
    folder = build_tiny_model(tmp_path_factory.mktemp("q") / "q", hidden=128, heads=4,
                              kv_heads=2, sliding_window=16)
    return Engine.load(str(folder))


def session_of(store, engine):
    return Session(store, engine, paths.kv_root(), paths.locks_dir())


@pytest.mark.parametrize("bits", [8, 4])
def test_resumed_from_disk_equals_the_cache_kept_in_memory(home, store, wide, bits,
                                                           monkeypatch):
    monkeypatch.setitem(kvquality.GATE, "agreement", 0.0)  # this test is about storage
    monkeypatch.setitem(kvquality.GATE, "nll", 99.0)
    # Its own cache folder: otherwise "disk" would start by sharing "mem"'s quantized prefix.
    live = Session(store, wide, paths.kv_root().parent / "kv-mem", paths.locks_dir())
    a = live.conversation("mem", kv_bits=bits)
    b = session_of(store, wide).conversation("disk", kv_bits=bits)
    f = session_of(store, wide).conversation("f16")
    quantized_differs, previous, lengths = False, None, []
    for i, prompt in enumerate(PROMPTS):
        in_memory, _ = run_turn(live, a, prompt, max_tokens=16)
        from_disk, notes = run_turn(session_of(store, wide), b, prompt, max_tokens=16)
        plain, _ = run_turn(session_of(store, wide), f, prompt, max_tokens=16)
        assert notes == []
        lengths.append(len(in_memory.tokens))
        assert from_disk.tokens == in_memory.tokens, f"turn {i + 1}"
        if previous is not None:  # the whole previous turn is reused
            u = previous.usage
            assert from_disk.usage.cached_tokens >= u.prompt_tokens + u.completion_tokens - 2
        previous = from_disk
        quantized_differs |= plain.tokens != from_disk.tokens
    assert sum(lengths) >= 40  # replies long enough for the equality to mean something
    # The segments hold quantized K/V: 8 (or 4) bits plus a float16 scale and bias per 32.
    man = CacheFolder(paths.kv_root() / str(b.id)).manifest()
    assert man.layout.kv_bits == bits
    tensor_bytes = 0
    for seg in man.segments:
        data = (paths.kv_root() / str(b.id) / seg.file).read_bytes()
        tensor_bytes += len(data) - 8 - int.from_bytes(data[:8], "little")
        assert b'"k.0.w"' in data[:4096]
    f16 = len(man.tokens) * wide.info().kv_bytes_per_token
    assert tensor_bytes <= (0.6 if bits == 8 else 0.35) * f16
    if bits == 4:  # negative control: 4-bit history does change this tiny model's replies
        assert quantized_differs


def test_a_failing_setting_is_refused_in_one_line(home, store, wide, monkeypatch):
    conv = session_of(store, wide).conversation("keep")
    monkeypatch.setitem(kvquality.GATE, "agreement", 1.01)
    with pytest.raises(BadInput, match="fails the quality gate"):
        session_of(store, wide).conversation("keep", kv_bits=4)
    assert store.get("keep").kv_bits is None and conv.kv_bits is None
    with pytest.raises(BadInput, match="must be 32, 64 or 128 and divide"):
        session_of(store, wide).conversation("keep", kv_bits=8, kv_group=128)


def test_changing_the_bits_rebuilds_once(home, store, wide):
    s = session_of(store, wide)
    conv = s.conversation("chg")
    run_turn(s, conv, PROMPTS[0])
    conv = session_of(store, wide).conversation("chg", kv_bits=8)
    got, notes = run_turn(session_of(store, wide), conv, PROMPTS[1])
    assert notes == ["cache rebuilt: KV cache bits changed"] and got.usage.cached_tokens == 0
    again, notes = run_turn(session_of(store, wide), conv, PROMPTS[2])
    assert notes == [] and again.usage.cached_tokens > got.usage.prompt_tokens


def test_cli_flag_is_remembered_and_gated(home, wide, monkeypatch):
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    model = str(wide.ref.path)

    def ask(*args):
        return subprocess.run([sys.executable, "-m", "localchat", "ask", "-m", model, "-c",
                               "cli", "--max-tokens", "8", "--json", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    first = ask("--kv-bits", "8", "Hello")
    assert first.returncode == 0, first.stderr
    second = ask("And then?")  # no flag: the conversation remembers 8 bits
    assert second.returncode == 0 and second.stderr == ""
    assert json.loads(second.stdout)["usage"]["cached_tokens"] > 0
    verdicts = json.loads((home / "kv-quality.json").read_text())
    assert any(k.endswith("|8|32|v1") for k in verdicts)
    bad = ask("--kv-bits", "8", "--kv-group-size", "128", "Hi")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "localchat: error: --kv-group-size" in bad.stderr
