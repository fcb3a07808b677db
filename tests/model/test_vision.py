"""Vision models (``model/vision.py``) on tiny random Qwen2-VL, SmolVLM and Gemma 3 built here
(``tests/tinyvlm.py``): they load through ``mlx_vlm.load`` as built; localchat's prefill of
an image conversation computes what mlx-vlm's own model call computes (the control: without
M-RoPE positions it does not); chunks may split an image; the install leaves out what it
overrode; and a vision folder without a supported family is refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tinyvlm import FAMILIES, build_tiny_vlm, random_png

ROOT = Path(__file__).parents[2]


picture = random_png


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {f: build_tiny_vlm(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def engines(vlms):
    from localchat.model.loading import load_engine

    return {f: load_engine(str(p)) for f, p in vlms.items()}


def drain(gen):
    try:
        while True:
            next(gen)
    except StopIteration as fin:
        return fin.value


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tiny_model_loads_as_built(vlms, family):
    """What mlx_vlm.load gives holds exactly the weights the builder wrote."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm import load

    model, _ = load(str(vlms[family]))
    saved = mx.load(str(vlms[family] / "model.safetensors"))
    got = dict(tree_flatten(model.parameters()))
    assert set(got) == set(saved)
    assert all(mx.array_equal(got[k], saved[k]) for k in saved)


def reference_logits(engine, digest: str, image_path: Path, text: str, mrope: bool = True):
    """mlx-vlm's own call on the whole prompt (its processor, its merge, its positions)."""
    from mlx_vlm.utils import prepare_inputs
    from PIL import Image

    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
        tokenize=False, add_generation_prompt=True)
    inputs = prepare_inputs(engine.processor, images=[Image.open(image_path).convert("RGB")],
                            prompts=[prompt])
    ids = inputs["input_ids"]
    rest = {k: v for k, v in inputs.items()
            if k not in ("input_ids", "pixel_values", "attention_mask")}
    merged = engine.vlm.get_input_embeddings(ids, inputs["pixel_values"],
                                             mask=inputs.get("attention_mask"), **rest)
    # Causal, as a cache runs it (mlx-vlm's own Gemma 3 call on a whole prompt passes an
    # all-ones mask: no causal mask at all, which no cache can reproduce).
    extra = {"position_ids": merged.position_ids} if mrope and merged.position_ids is not None \
        else {}
    out = engine.vlm.language_model(ids, inputs_embeds=merged.inputs_embeds, **extra)
    return getattr(out, "logits", out)[:, -1, :], ids.tolist()[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_computes_what_mlx_vlm_computes(engines, home, tmp_path, family):
    import mlx.core as mx

    from localchat import paths
    from localchat.store.images import ImageStore

    engine = engines[family]
    path = picture(tmp_path / "a.png")
    info = ImageStore(paths.images_dir()).add(path)
    keys = engine.render([{"role": "user", "content": "What is it?", "images": [info.digest]}])
    ref, ids = reference_logits(engine, info.digest, path, "What is it?")
    assert [engine.image_token if k >= engine.vocab else k for k in keys] == ids
    assert sum(k >= engine.vocab for k in keys) >= 4  # the image is there, keyed
    for chunk in (512, 3):  # one pass, and chunks that split the image
        got = drain(engine.prefill(keys, engine.new_cache(), chunk=chunk, before=[]))
        # (the K/V are rounded to float16 as they enter the cache: close, not equal)
        assert mx.argmax(got).item() == mx.argmax(ref).item()
        assert float(mx.abs(got - ref).max()) < 0.02 * float(mx.abs(ref).max())
    if family == "qwen2_vl":
        # The control: text positions as plain offsets (no M-RoPE shift) are told apart.
        ref_flat, _ = reference_logits(engine, info.digest, path, "What is it?", mrope=False)
        assert float(mx.abs(ref_flat - ref).max()) > 0.05 * float(mx.abs(ref).max())


def test_chunks_split_an_image_anywhere(engines, home, tmp_path):
    """Any chunking gives the same logits, up to the float rounding of other matmul shapes
    (each position has its row and its position)."""
    import mlx.core as mx

    from localchat import paths
    from localchat.store.images import ImageStore

    engine = engines["qwen2_vl"]
    info = ImageStore(paths.images_dir()).add(picture(tmp_path / "a.png"))
    keys = engine.render([{"role": "user", "content": "Hi", "images": [info.digest]}])
    whole = drain(engine.prefill(keys, engine.new_cache(), before=[]))
    for chunk in (1, 2, 5, 7):
        got = drain(engine.prefill(keys, engine.new_cache(), chunk=chunk, before=[]))
        assert mx.argmax(got).item() == mx.argmax(whole).item()
        assert mx.allclose(got, whole, atol=1e-3, rtol=1e-4).item(), chunk


def test_a_vision_family_localchat_does_not_keep_is_refused(vlms, tmp_path):
    from localchat.errors import ModelBroken
    from localchat.model.loading import load_engine

    folder = tmp_path / "other"
    shutil.copytree(vlms["qwen2_vl"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llava"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelBroken, match="vision model family 'llava' is not supported"):
        load_engine(str(folder))


def test_the_vision_path_imports_none_of_the_overridden_requirements(vlms, tmp_path):
    """The lock drops datasets, opencv, audio and mlx-vlm's server stack
    (pyproject ``override-dependencies``): loading and running a vision model needs none."""
    code = (
        "import sys; from localchat.model.loading import load_engine; "
        f"e = load_engine({str(vlms['smolvlm'])!r}); e.info(); "
        "print(sorted(m for m in ('cv2', 'datasets', 'mlx_audio', 'miniaudio', 'fastapi', "
        "'websockets', 'torch') if m in sys.modules)); print('mlx_vlm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "True"]  # (and it did load mlx-vlm)
