"""Tiny random vision-language models (Qwen2-VL, SmolVLM / Idefics3, Gemma 3), built from a
config dict in about a second, loading through ``mlx_vlm.load``; no downloads.

Each folder holds what a Hub checkpoint holds, made small: config.json with a
``vision_config``, model.safetensors (random weights, std ~0.3 so greedy replies depend on
the image and the text), a byte-level BPE tokenizer.json whose image tokens are specials, a
chat template with image parts, and the processor's preprocessor_config.json /
processor_config.json sized so an image is a few dozen tokens.

    build_tiny_vlm(Path("/tmp/qwen"), "qwen2_vl")
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny import CORPUS

FAMILIES = ("qwen2_vl", "smolvlm", "gemma3")
STD = 0.3  # random weights' spread: large enough that the output depends on the context

# ChatML with Qwen2-VL's image part.
QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SMOL_TEMPLATE = (
    "<|im_start|>{% for message in messages %}"
    "{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}"
    "{% else %}{{ ': ' }}{% endif %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

SPECIALS = {
    "qwen2_vl": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "smolvlm": ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<image>",
                "<fake_token_around_image>", "<global-img>"]
    + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
    "gemma3": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
               "<start_of_image>", "<end_of_image>", "<image_soft_token>"],
}


def _tokenizer(out: Path, family: str, template: str, ends: tuple[str, str, str]):
    """Train the BPE, write tokenizer.json / tokenizer_config.json; the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS[family],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    bos, eos, pad = ends
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "pad_token": pad, "unk_token": pad, "add_bos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
        "chat_template": template}))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    return tok


def _text(tok, hidden: int = 64, layers: int = 2) -> dict:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": hidden * 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
            "vocab_size": tok.get_vocab_size(), "max_position_embeddings": 4096,
            "tie_word_embeddings": False}


def _qwen(out: Path) -> dict:
    tok = _tokenizer(out, "qwen2_vl", QWEN_TEMPLATE,
                     ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    ids = tok.token_to_id
    text = _text(tok)
    config = {
        "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
        **text, "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "image_token_id": ids("<|image_pad|>"), "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"), "eos_token_id": ids("<|im_end|>"),
        "vision_config": {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32,
                          "hidden_size": text["hidden_size"], "num_heads": 2,
                          "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "mlp_ratio": 2, "in_channels": 3},
    }
    # 28-pixel units (patch 14 x merge 2): at most 16 units, an image is <= 16 tokens.
    pre = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16, "patch_size": 14,
           "temporal_patch_size": 2, "merge_size": 2,
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
           "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(pre))
    return config


def _smolvlm(out: Path) -> dict:
    tok = _tokenizer(out, "smolvlm", SMOL_TEMPLATE,
                     ("<|im_start|>", "<end_of_utterance>", "<|endoftext|>"))
    text = _text(tok)
    config = {
        "model_type": "smolvlm", "architectures": ["SmolVLMForConditionalGeneration"],
        "image_token_id": tok.token_to_id("<image>"), "scale_factor": 2,
        "vocab_size": text["vocab_size"], "eos_token_id": tok.token_to_id("<end_of_utterance>"),
        "text_config": {"model_type": "llama", **text, "rope_theta": 10000.0},
        # 32-pixel tiles of 8-pixel patches: 16 patches, 4 tokens after the 2x2 shuffle.
        "vision_config": {"model_type": "smolvlm_vision", "hidden_size": 32,
                          "num_attention_heads": 2, "num_hidden_layers": 2,
                          "intermediate_size": 64, "patch_size": 8, "image_size": 32},
    }
    # Up to 2x2 tiles of 32 pixels and a global image: the token count follows the size.
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "SmolVLMImageProcessor", "processor_class": "SmolVLMProcessor",
        "do_resize": True, "size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32},
        "do_image_splitting": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_pad": True, "resample": 1, "do_convert_rgb": True}))
    (out / "processor_config.json").write_text(json.dumps({
        "image_seq_len": 4, "processor_class": "SmolVLMProcessor"}))
    return config


def _gemma3(out: Path) -> dict:
    tok = _tokenizer(out, "gemma3", GEMMA_TEMPLATE, ("<bos>", "<end_of_turn>", "<pad>"))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["extra_special_tokens"] = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                   "image_token": "<image_soft_token>"}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    text = _text(tok)
    config = {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "image_token_index": tok.token_to_id("<image_soft_token>"),
        "boi_token_index": tok.token_to_id("<start_of_image>"),
        "eoi_token_index": tok.token_to_id("<end_of_image>"),
        "vocab_size": text["vocab_size"], "hidden_size": text["hidden_size"], "pad_token_id": 0,
        "eos_token_id": [tok.token_to_id("<end_of_turn>"), tok.token_to_id("<eos>")],
        # Layer 0 slides over 16 tokens (a RotatingKVCache: bounded), layer 1 is global.
        "text_config": {"model_type": "gemma3_text", **text, "head_dim": 16,
                        "query_pre_attn_scalar": 16, "sliding_window": 16,
                        "sliding_window_pattern": 2, "mm_tokens_per_image": 4,
                        "rope_global_base_freq": 10000.0, "rope_local_base_freq": 10000.0},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32,
                          "num_attention_heads": 2, "num_hidden_layers": 2,
                          "intermediate_size": 64, "patch_size": 8, "image_size": 32},
    }
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "do_resize": True, "size": {"height": 32, "width": 32}, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "resample": 2, "do_convert_rgb": True,
        "do_pan_and_scan": False}))
    (out / "processor_config.json").write_text(json.dumps({
        "image_seq_length": 4, "processor_class": "Gemma3Processor"}))
    return config


FAMILY_BUILDERS = {"qwen2_vl": _qwen, "smolvlm": _smolvlm, "gemma3": _gemma3}


def build_tiny_vlm(out: Path, family: str = "qwen2_vl", *, seed: int = 0) -> Path:
    """Write a tiny random ``family`` model into ``out`` (made if missing); ``out``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    out.mkdir(parents=True, exist_ok=True)
    config = FAMILY_BUILDERS[family](out)
    (out / "config.json").write_text(json.dumps(config))
    # As ``mlx_vlm.utils.load_model`` builds it (from_dict fills text_config in place).
    loaded = json.loads(json.dumps(config))
    arch, _ = get_model_and_args(loaded)
    for part in ("text_config", "vision_config", "audio_config"):
        loaded.setdefault(part, {})
    model_config = arch.ModelConfig.from_dict(loaded)
    model_config = update_module_configs(model_config, arch, loaded,
                                         ["text", "vision", "perceiver", "projector", "audio"])
    model = arch.Model(model_config)
    mx.random.seed(seed)
    params = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "norm1.weight",
                          "norm2.weight", "ln_q.weight")) or "layernorm" in name:
            params[name] = mx.ones_like(value)
        elif name.endswith(".bias"):
            params[name] = mx.zeros_like(value)
        else:
            params[name] = (mx.random.normal(value.shape) * STD).astype(mx.float32)
    if family == "gemma3":  # mlx-vlm ties Gemma 3's head to its embeddings on load
        params["language_model.lm_head.weight"] = params["language_model.model.embed_tokens.weight"]
    model.update(tree_unflatten(list(params.items())))
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
    return out


def random_image(w: int = 90, h: int = 60, seed: int = 0):
    """A w×h RGB picture of noise (PIL): each seed another picture of the same size."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def random_png(path: Path, w: int = 90, h: int = 60, seed: int = 0) -> Path:
    """``random_image`` saved at ``path``."""
    random_image(w, h, seed).save(path)
    return path
