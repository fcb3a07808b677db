"""SwiGLU and tanh-GELU for the CPU backend, without MLX's CPU ``exp`` and ``tanh``.

What it is: drop-ins for mlx-lm's ``swiglu(gate, x)`` (``silu(gate) * x``, the MLP of Llama,
Qwen, Mistral and most families mlx-lm runs: 72 of its model modules import it) and for MLX's
``nn.gelu_approx`` (the tanh GELU of Gemma 2/3/4, GPT-2, GPT-NeoX…: 11 modules call it as
``nn.gelu_approx``), put in place by ``install()`` when a model is loaded on the CPU path:
``swiglu`` in ``mlx_lm.models.activations`` and in every loaded model module that imported it
by name, ``gelu_approx`` on ``mlx.nn``. ``LOCALCHAT_CPU_ACTIVATIONS=mlx`` keeps MLX's.

What it is not: used on Metal or CUDA (``install`` does nothing there), for dtypes other than
float32 (the CPU path computes in float32), for small calls or inside ``mx.compile``; all of
those run the original function, so the choice depends on the shapes only and a given call
always takes the same path.

Why: on the CPU, MLX computes ``exp`` and ``tanh`` one element at a time (~14-23 ns each),
and the sigmoid of a SwiGLU costs more than the matmul before it: for 64 prompt tokens of the
default model one layer's ``swiglu`` took 1.89 ms against 0.94 ms for a 64×1536×576 matmul;
NumPy's vectorised ``exp`` does the whole ``gate / (1 + exp(-gate)) * x`` in 0.28 ms (7x). At
a 512-token chunk that is ~13 ms a layer, ~0.39 s of a ~1.8 s chunk on 30 layers. NumPy's
float32 ``tanh`` here: 2.6 ns per element.

How: the inputs are evaluated (the detour's cost: one ``mx.eval``, ~40 µs, hence
``MIN_ELEMENTS``), NumPy computes in one buffer of its own, and MLX takes a copy of it.
Results agree with MLX's to float32 rounding.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV = "LOCALCHAT_CPU_ACTIVATIONS"

# Below this many elements MLX's own functions run: the eval costs ~40 µs, MLX's
# sigmoid ~16 ns per element more than NumPy's. Decode (one row of 1,536 on the default
# model, four batched rows 6,144) stays in MLX; a prompt of 6+ tokens comes here.
MIN_ELEMENTS = 8192

_original: Any = None  # mlx-lm's swiglu while ours is installed
_gelu: Any = None  # MLX's gelu_approx while ours is installed


def _model_modules():
    return [m for name, m in list(sys.modules.items())
            if name == "mlx_lm.models" or name.startswith("mlx_lm.models.")]


def install() -> bool:
    """Put ``swiglu`` and ``gelu_approx`` in place of MLX's on the CPU path
    (``backend.cpu_path``) unless ``LOCALCHAT_CPU_ACTIVATIONS`` is ``mlx``: ``swiglu`` in
    mlx-lm's ``activations`` module and every loaded ``mlx_lm.models`` module that imported
    it, ``gelu_approx`` on ``mlx.nn``. Call it after a model's module is imported (each
    ``Engine.load`` does: modules imported since get it too).

    Returns:
        True if ours are in place after the call.
    """
    global _original, _gelu
    if os.environ.get(ENV, "").lower() == "mlx":
        return False
    from . import backend

    if not backend.cpu_path():
        return False
    try:
        import mlx.nn as nn
        from mlx_lm.models import activations
    except ImportError:
        return False
    if _original is None:
        _original = activations.swiglu
    if _gelu is None:
        _gelu = nn.gelu_approx
        nn.gelu_approx = gelu_approx
    for module in _model_modules():
        if getattr(module, "swiglu", None) is _original:
            module.swiglu = swiglu
    return True


def uninstall() -> None:
    """Give MLX its own functions back (benchmarks and tests compare the two)."""
    global _original, _gelu
    if _original is not None:
        for module in _model_modules():
            if getattr(module, "swiglu", None) is swiglu:
                module.swiglu = _original
        _original = None
    if _gelu is not None:
        import mlx.nn as nn

        if nn.gelu_approx is gelu_approx:
            nn.gelu_approx = _gelu
        _gelu = None


def installed() -> bool:
    return _original is not None


def reference():
    """mlx-lm's own ``swiglu``, whether or not ours is installed."""
    if _original is not None:
        return _original
    from mlx_lm.models.activations import swiglu as theirs

    return theirs


def gelu_reference():
    """MLX's own ``gelu_approx``, whether or not ours is installed."""
    if _gelu is not None:
        return _gelu
    import mlx.nn as nn

    return nn.gelu_approx


def _host(*arrays) -> bool:
    """Whether ``arrays`` (float32, of one shape, large enough) can go through NumPy: then
    they are evaluated here (False inside ``mx.compile``, where nothing may be)."""
    import mlx.core as mx

    from .attention import evaluate

    first = arrays[0]
    if any(a.dtype != mx.float32 or a.shape != first.shape for a in arrays) or \
            first.size < MIN_ELEMENTS:
        return False
    return evaluate(list(arrays))


def swiglu(gate, x):
    """``silu(gate) * x`` as mlx-lm's, with the ``exp`` in NumPy for large float32 calls."""
    if not _host(gate, x):
        return reference()(gate, x)
    import mlx.core as mx
    import numpy as np

    g = np.array(gate, copy=False)
    out = np.empty(g.shape, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # exp(-g) overflows to inf: silu 0
        np.negative(g, out=out)
        np.exp(out, out=out)
        out += 1
        np.divide(g, out, out=out)
        out *= np.array(x, copy=False)
    return mx.array(out)


_SQRT_2_OVER_PI = 0.7978845608028654  # math.sqrt(2 / math.pi), as MLX's


def gelu_approx(x):
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` as MLX's, with the ``tanh`` in
    NumPy for large float32 calls."""
    if not _host(x):
        return gelu_reference()(x)
    import mlx.core as mx
    import numpy as np

    a = np.array(x, copy=False)
    out = np.empty(a.shape, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        np.multiply(a, a, out=out)
        out *= a
        out *= np.float32(0.044715)
        out += a
        out *= np.float32(_SQRT_2_OVER_PI)
        np.tanh(out, out=out)
        out += 1
        out *= a
        out *= np.float32(0.5)
    return mx.array(out)
