"""CPU SwiGLU and tanh-GELU without MLX's ``exp``/``tanh`` (``localchat/cpu/activations.py``):
MLX's results, the same greedy replies, resumed turns equal to full prefills, and MLX's own
functions wherever ours do not apply."""

import numpy as np
import pytest
from families import build_family, greedy
from twins import full_prefill, run_turn

from localchat import paths
from localchat.cpu import activations
from localchat.model.engine import Engine
from localchat.session.session import Session


@pytest.fixture
def reference():
    return activations.reference()


def inputs(rows: int, width: int, seed: int = 0):
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    gate = rng.normal(0, 4, (1, rows, width)).astype(np.float32)
    gate[0, 0, :6] = [0.0, -0.0, 88.0, -88.0, 200.0, -200.0]  # exp over/underflow at the edges
    x = rng.normal(0, 1, (1, rows, width)).astype(np.float32)
    return mx.array(gate), mx.array(x)


@pytest.mark.parametrize("rows,width", [(64, 128), (7, 1536), (512, 96)])
def test_matches_mlx_lms_swiglu(reference, rows, width, monkeypatch):
    """Ours (the NumPy path taken, not the fallback) agrees with mlx-lm's to float32 rounding;
    control: silu(gate) without the product is far from it."""
    import mlx.core as mx
    import mlx.nn as nn

    gate, x = inputs(rows, width)
    called = []
    monkeypatch.setattr(activations, "reference",
                        lambda: (lambda g, v: called.append(1) or reference(g, v)))
    ours = activations.swiglu(gate, x)
    assert not called, "fell back to mlx-lm's swiglu"
    theirs = reference(gate, x)
    assert ours.shape == theirs.shape and ours.dtype == mx.float32
    a, b = np.array(ours), np.array(theirs)
    assert np.allclose(a, b, rtol=2e-6, atol=1e-6)
    assert not np.allclose(np.array(nn.silu(gate)), b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("rows,width", [(64, 128), (512, 96)])
def test_gelu_matches_mlxs_gelu_approx(rows, width, monkeypatch):
    """Ours (the NumPy path) agrees with MLX's tanh GELU to float32 rounding; control: the
    exact (erf) GELU is told apart."""
    import mlx.nn as nn

    theirs = activations.gelu_reference()
    gate, _ = inputs(rows, width)
    called = []
    monkeypatch.setattr(activations, "gelu_reference",
                        lambda: (lambda v: called.append(1) or theirs(v)))
    ours = activations.gelu_approx(gate)
    assert not called, "fell back to MLX's gelu_approx"
    a, b = np.array(ours), np.array(theirs(gate))
    assert np.allclose(a, b, rtol=2e-6, atol=2e-6)
    assert not np.allclose(np.array(nn.gelu(gate)), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["small", "float16", "bfloat16", "compiled"])
def test_gelu_everywhere_else_is_mlxs_own(case, monkeypatch):
    import mlx.core as mx

    theirs = activations.gelu_reference()
    gate, _ = inputs(64, 128)
    if case == "small":
        gate = gate[:, :2]
    elif case in ("float16", "bfloat16"):
        gate = gate.astype(getattr(mx, case))
    called = []
    monkeypatch.setattr(activations, "gelu_reference",
                        lambda: (lambda v: called.append(1) or theirs(v)))
    fn = mx.compile(activations.gelu_approx) if case == "compiled" else activations.gelu_approx
    got = fn(gate)
    assert called
    assert np.array_equal(np.array(got.astype(mx.float32)),
                          np.array(theirs(gate).astype(mx.float32)))


@pytest.mark.parametrize("case", ["small", "float16", "bfloat16", "broadcast", "compiled"])
def test_everything_else_is_mlx_lms_own(reference, case, monkeypatch):
    """Small calls, other dtypes, shapes that broadcast and calls inside ``mx.compile`` run
    mlx-lm's function: the result is exactly its."""
    import mlx.core as mx

    gate, x = inputs(64, 128)
    if case == "small":
        gate, x = gate[:, :2], x[:, :2]
    elif case in ("float16", "bfloat16"):
        gate, x = gate.astype(getattr(mx, case)), x.astype(getattr(mx, case))
    elif case == "broadcast":
        x = x[:, :1]
    called = []
    monkeypatch.setattr(activations, "reference",
                        lambda: (lambda g, v: called.append(1) or reference(g, v)))
    if case == "compiled":
        got = mx.compile(activations.swiglu)(gate, x)
    else:
        got = activations.swiglu(gate, x)
    assert called
    assert np.array_equal(np.array(got.astype(mx.float32)),
                          np.array(reference(gate, x).astype(mx.float32)))


def test_a_cpu_load_puts_it_in_the_model_modules_and_uninstall_gives_it_back(tmp_path,
                                                                             monkeypatch):
    import mlx.nn as nn
    import mlx_lm.models.activations as theirs
    import mlx_lm.models.llama as llama

    Engine.load(str(build_family("llama", tmp_path / "llama")))
    assert activations.installed()
    assert llama.swiglu is activations.swiglu and theirs.swiglu is activations.swiglu
    assert nn.gelu_approx is activations.gelu_approx
    original, gelu = activations.reference(), activations.gelu_reference()
    activations.uninstall()
    try:
        assert llama.swiglu is original and not activations.installed()
        assert nn.gelu_approx is gelu
        monkeypatch.setenv(activations.ENV, "mlx")
        assert activations.install() is False and llama.swiglu is original
        assert nn.gelu_approx is gelu
    finally:
        monkeypatch.delenv(activations.ENV)
        activations.install()
    assert llama.swiglu is activations.swiglu and nn.gelu_approx is activations.gelu_approx


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_greedy_replies_and_resumed_turns_with_it_on_every_call(family, tmp_path, store,
                                                                monkeypatch):
    """Ours on every call (no minimum size): greedy continuations are MLX's own functions',
    and a resumed turn's reply equals a full prefill's, token for token (the cache
    guarantee). llama and qwen3 run SwiGLU, gemma3 the tanh GELU."""
    import mlx.nn as nn

    folder = build_family(family, tmp_path / family)
    engine = Engine.load(str(folder))
    monkeypatch.setattr(activations, "MIN_ELEMENTS", 0)
    calls = []
    if family == "gemma3_text":
        owner, name, real, theirs = nn, "gelu_approx", activations.gelu_approx, \
            activations.gelu_reference()
    else:
        owner = __import__(f"mlx_lm.models.{family}", fromlist=["swiglu"])
        name, real, theirs = "swiglu", activations.swiglu, activations.reference()

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(owner, name, counted)
    prompt = engine.encode("The capital of France is Paris. What is the capital of Korea?")
    ours = greedy(engine.model, prompt, 12)
    assert calls  # the model's MLP went through ours
    monkeypatch.setattr(owner, name, theirs)
    assert greedy(engine.model, prompt, 12) == ours

    monkeypatch.setattr(owner, name, counted)
    session = Session(store, engine, paths.kv_root(), paths.locks_dir())
    conv = store.create("c", engine.ref.name)
    run_turn(session, conv, "Tell me about the river and the city.")
    before = store.messages(conv)
    manifest = (paths.kv_root() / str(conv.id) / "manifest.json").read_text()
    calls.clear()
    got, _ = run_turn(session, conv, "And the mountains?")
    assert got.usage.cached_tokens > 0 and calls
    ref = full_prefill(store, engine, conv, "And the mountains?", before, manifest)
    assert len(ref.tokens) >= 4 and got.tokens == ref.tokens
