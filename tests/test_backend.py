"""The Linux CPU fast path: OpenBLAS loaded before MLX, quantized weights run as float32."""

import json
import shutil
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from localchat import backend
from localchat.engine import Engine


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_openblas_is_loaded_on_linux():
    assert backend.blas_in_use() and "openblas" in backend.blas_in_use()


@pytest.fixture
def quantized_model(tiny_model, tmp_path):
    """The tiny model with 4-bit weights, as mlx-lm saves quantized models."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    out = tmp_path / "tiny-q4"
    shutil.copytree(tiny_model, out)
    model, config = load_model(out)
    nn.quantize(model, group_size=32, bits=4)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config["quantization"] = {"group_size": 32, "bits": 4}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_cpu_runs_quantized_weights_dequantized_and_caches_them(home, quantized_model):
    from mlx_lm.utils import load_model

    reference, _ = load_model(quantized_model)  # still quantized
    x = mx.array([[5, 17, 42, 99, 7]])
    expected = reference(x)

    first = Engine.load(str(quantized_model))
    layers = [m for _, m in first.model.named_modules()]
    assert not any(isinstance(m, nn.QuantizedLinear) for m in layers)
    assert any(isinstance(m, nn.Linear) and m.weight.dtype == mx.float32 for m in layers)
    cached = list((home / "cpu-weights").glob("*.safetensors"))
    assert len(cached) == 1
    second = Engine.load(str(quantized_model))  # from the weights cache this time
    out1, out2 = first.model(x), second.model(x)
    assert mx.array_equal(out1, out2)
    assert mx.allclose(out1, expected.astype(mx.float32), atol=1e-3, rtol=1e-3)
