"""SwiGLU for the CPU backend whose ``silu`` does not go through MLX's CPU ``exp``.

What it is: a drop-in for mlx-lm's ``swiglu(gate, x)`` (``silu(gate) * x``, the MLP of
Llama, Qwen, Mistral and most families mlx-lm runs: 72 of its model modules import it), put
in place of it by ``install()`` when a model is loaded on the CPU path, in
``mlx_lm.models.activations`` and in every loaded model module that imported it by name.
``LOCALCHAT_CPU_SWIGLU=mlx`` keeps mlx-lm's.

What it is not: used on Metal or CUDA (``install`` does nothing there), for dtypes other than
float32 (the CPU path computes in float32), for small calls or inside ``mx.compile``; all of
those run mlx-lm's own function, so the choice depends on the shapes only and a given call
always takes the same path.

Why: on the CPU, MLX computes ``exp`` one element at a time (~14-23 ns each), and the sigmoid
of a SwiGLU costs more than the matmul before it: for 64 prompt tokens of the default model
one layer's ``swiglu`` took 1.89 ms against 0.94 ms for a 64×1536×576 matmul; NumPy's
vectorised ``exp`` does the whole ``gate / (1 + exp(-gate)) * x`` in 0.28 ms (7x). At a
512-token chunk that is ~13 ms a layer, ~0.39 s of a ~1.8 s chunk on 30 layers.

How: both inputs are evaluated (the detour's cost: one ``mx.eval``, ~40 µs, hence
``MIN_ELEMENTS``), NumPy computes in one buffer of its own, and MLX takes a copy of it.
Results agree with mlx-lm's to float32 rounding (both are a float32 ``exp``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV = "LOCALCHAT_CPU_SWIGLU"

# Below this many elements mlx-lm's own ``swiglu`` runs: the eval costs ~40 µs, MLX's
# sigmoid ~16 ns per element more than NumPy's. Decode (one row of 1,536 on the default
# model, four batched rows 6,144) stays in MLX; a prompt of 6+ tokens comes here.
MIN_ELEMENTS = 8192

_original: Any = None  # mlx-lm's function while ours is installed


def install() -> bool:
    """Put ``swiglu`` in place of mlx-lm's on the CPU path (``backend.cpu_path``), in its
    ``activations`` module and every loaded ``mlx_lm.models`` module that imported it, unless
    ``LOCALCHAT_CPU_SWIGLU`` is ``mlx``. Call it after a model's module is imported (each
    ``Engine.load`` does: modules imported since get it too).

    Returns:
        True if ours is in place after the call.
    """
    global _original
    if os.environ.get(ENV, "").lower() == "mlx":
        return False
    from . import backend

    if not backend.cpu_path():
        return False
    try:
        from mlx_lm.models import activations
    except ImportError:
        return False
    if _original is None:
        _original = activations.swiglu
    for name, module in list(sys.modules.items()):
        if (name == "mlx_lm.models" or name.startswith("mlx_lm.models.")) and \
                getattr(module, "swiglu", None) is _original:
            module.swiglu = swiglu
    return True


def uninstall() -> None:
    """Give mlx-lm its own ``swiglu`` back (benchmarks and tests compare the two)."""
    global _original
    if _original is None:
        return
    for name, module in list(sys.modules.items()):
        if (name == "mlx_lm.models" or name.startswith("mlx_lm.models.")) and \
                getattr(module, "swiglu", None) is swiglu:
            module.swiglu = _original
    _original = None


def installed() -> bool:
    return _original is not None


def reference():
    """mlx-lm's own ``swiglu``, whether or not ours is installed."""
    if _original is not None:
        return _original
    from mlx_lm.models.activations import swiglu as theirs

    return theirs


def swiglu(gate, x):
    """``silu(gate) * x`` as mlx-lm's, with the ``exp`` in NumPy for large float32 calls."""
    import mlx.core as mx

    theirs = reference()
    if gate.dtype != mx.float32 or x.dtype != mx.float32 or gate.shape != x.shape or \
            gate.size < MIN_ELEMENTS:
        return theirs(gate, x)
    try:
        mx.eval(gate, x)
    except ValueError:  # "Attempting to eval an array during function transformations"
        return theirs(gate, x)
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
