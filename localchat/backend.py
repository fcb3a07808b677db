"""Fast settings for the MLX backend this process runs on; no-ops on Metal and CUDA.

On Linux CPU the stock ``mlx[cpu]`` wheel links a reference BLAS (~5-8 GFLOP/s for a 1024²
f32 matmul) and quantized matmuls use no BLAS at all, so a 4-bit model prefills at ~11 tok/s.
Two changes make it fast there:

- ``prepare()``, before ``mlx.core`` is imported, loads OpenBLAS with ``RTLD_GLOBAL`` so that
  libmlx's ``cblas_sgemm`` binds to it (~250-470 GFLOP/s here). It looks for the
  ``cmeel-openblas`` wheel (a Linux dependency of localchat), then the system's libopenblas.
  ``LOCALCHAT_BLAS=/path/to/libopenblas.so`` picks one; ``LOCALCHAT_BLAS=off`` disables it.
- ``tune(model)``, after loading, dequantizes quantized layers to float32 when the default
  device is the CPU, so every matmul goes through that BLAS (measured on the default model:
  prefill 10 → 320 tok/s, decode 9 → 21 tok/s; float16 on CPU is slower than float32). The
  dequantized weights are kept on disk so later starts skip the work.

Neither touches a Metal or CUDA run: there the quantized kernels are the fast path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

_blas: str | None = None


def prepare() -> str | None:
    """Load a fast BLAS globally if this is a Linux CPU process; return its path or None."""
    global _blas
    if _blas is not None or not sys.platform.startswith("linux"):
        return _blas
    choice = os.environ.get("LOCALCHAT_BLAS", "")
    if choice.lower() in ("off", "0", "no"):
        return None
    for path in [choice] if choice else _candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _blas = path
        return path
    return None


def _candidates() -> list[str]:
    found = []
    for entry in sys.path:
        lib = Path(entry) / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if lib.is_file():
            found.append(str(lib))
    system = ctypes.util.find_library("openblas")
    if system:
        found.append(system)
    return found


def blas_in_use() -> str | None:
    return _blas


def on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


def tune(model, weights_cache: Path | None = None) -> None:
    """On the CPU, replace quantized layers by float32 ones (BLAS matmuls).

    Dequantizing the default model takes ~1.6 s, so the float32 result is kept in
    ``weights_cache`` (540 MB for the default model; float16 would halve that but casting back
    costs ~0.5 s per start on the CPU) and the next start maps it in ~0.1-0.4 s. Models whose
    float32 weights would not fit comfortably in memory (over ``LOCALCHAT_DEQUANTIZE_MAX_GB``,
    default 4) stay quantized.
    """
    if not on_cpu() or os.environ.get("LOCALCHAT_DEQUANTIZE") == "0":
        return
    import mlx.core as mx
    import mlx.nn as nn

    quantized = [(name, mod) for name, mod in model.named_modules()
                 if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    if not quantized:
        return
    elements = sum(mod.weight.size * 32 // mod.bits for _, mod in quantized)
    if elements * 4 > float(os.environ.get("LOCALCHAT_DEQUANTIZE_MAX_GB", "4")) * 2**30:
        return
    dense = _load_dense(weights_cache)
    if dense is None or set(dense) != {name for name, _ in quantized}:
        dense = {name: mx.dequantize(mod.weight, mod.scales, mod.biases, mod.group_size,
                                     mod.bits).astype(mx.float32)
                 for name, mod in quantized}
        _save_dense(weights_cache, dense)
    for name, mod in quantized:
        w = dense[name]
        if isinstance(mod, nn.QuantizedLinear):
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in mod)
            if "bias" in mod:
                new.bias = mod.bias.astype(mx.float32)
        else:
            new = nn.Embedding(w.shape[0], w.shape[1])
        new.weight = w
        _set_child(model, name, new)
    mx.eval(model.parameters())


def _load_dense(path: Path | None) -> dict | None:
    if path is None or not path.is_file():
        return None
    import mlx.core as mx

    try:
        return mx.load(str(path))
    except Exception:  # noqa: BLE001 - a damaged cache file is just recomputed
        return None


def _save_dense(path: Path | None, dense: dict) -> None:
    if path is None:
        return
    import mlx.core as mx

    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(tmp), dense)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # only a speed-up; a full disk just means slower starts


def _set_child(root, dotted: str, new) -> None:
    *parents, last = dotted.split(".")
    node = root
    for p in parents:
        node = node[int(p)] if p.isdigit() else getattr(node, p)
    if last.isdigit():
        node[int(last)] = new
    else:
        setattr(node, last, new)
