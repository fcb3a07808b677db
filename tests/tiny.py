"""A tiny random llama with an offline byte-level BPE tokenizer, built in about a second.

Used by the tests (and usable by scripts) instead of any download. The tokenizer is trained
on a few English and Korean sentences; the chat template is ChatML, like SmolLM2's.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = [
    "The capital of France is Paris. What is the capital of Korea? It is Seoul.",
    "Hello, how are you today? I am fine, thank you. Let us talk about caches.",
    "def main():\n    print('hello world')\n    return 0\n",
    "안녕하세요. 오늘 날씨가 좋네요. 서울은 한국의 수도입니다.",
    "한국어와 영어 모두 지원합니다. 캐시가 디스크에 저장됩니다.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and lists: - one - two - three",
] * 20

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_model(out: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                     kv_heads: int = 2, context: int = 1024, seed: int = 0,
                     dtype: str = "float32", sliding_window: int | None = None,
                     extra_special: tuple[str, ...] = ()) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json.

    ``extra_special``: more special tokens in the vocabulary (other models' end tokens)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL + list(extra_special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": context, "chat_template": CHATML,
    }))
    config = {
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": hidden * 2, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
        "vocab_size": tok.get_vocab_size(), "rope_theta": 10000.0,
        "max_position_embeddings": context, "tie_word_embeddings": False,
        "eos_token_id": tok.token_to_id("<|im_end|>"),
    }
    if sliding_window:  # every other layer attends to a window: RotatingKVCache
        config["sliding_window"] = sliding_window
        config["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    (out / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Default init makes a random model repeat its input token; larger attention/MLP weights
    # make each next token depend on the context, so equality tests can tell runs apart.
    params = dict(tree_flatten(model.parameters()))
    for k, v in params.items():
        if k.endswith(("o_proj.weight", "down_proj.weight", "v_proj.weight")):
            params[k] = v * 6
        elif k.endswith(("q_proj.weight", "k_proj.weight")):
            params[k] = v * 4
    model.load_weights(list(params.items()))
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out
