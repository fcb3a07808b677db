"""Tiny random-weight models, one per mlx-lm architecture family, for localchat's cache tests.

``build_family(name, out)`` writes a folder that ``mlx_lm.utils.load_model`` loads like a
real checkpoint: ``config.json``, ``model.safetensors`` (float32) and the same offline
byte-level BPE tokenizer as ``tiny.py`` (``tokenizer.json``, ``tokenizer_config.json`` with
the ChatML template; 498 tokens, ``<|im_end|>`` = 2 = eos_token_id: feed no id >= 498, an
out-of-range id reads garbage, not an error). Each model has 2-4 layers and hidden size 64, and
builds and loads in well under a second; sliding windows and attention chunks are 16 tokens,
so a conversation of a few turns runs well past them.

Which family covers which cache class (``make_prompt_cache(model)`` leaves, CacheLists
flattened; see ``cache_classes``):

=============  ==========================================================================
family         cache leaves
=============  ==========================================================================
llama          KVCache x2
qwen3          KVCache x2 (q/k norms)
deepseek_v3    KVCache x2, MLA: keys are the compressed latent (kv_lora_rank wide), values
               the rope key (qk_rope_head_dim wide), one head; layer 1 is MoE
gemma3_text    RotatingKVCache (window 16) x2 + KVCache (global) x1
gpt_oss        RotatingKVCache (window 16) + KVCache; attention sinks, MoE
llama4         ChunkedKVCache (chunk 16) x3 + KVCache x1 (layer 3: global, no rope, MoE)
qwen3_next     ArraysCache (gated-delta linear attention: conv + recurrent state) + KVCache
lfm2           KVCache + ArraysCache (short conv) + KVCache
mamba2         ArraysCache x2 only (pure recurrent, no attention at all)
falcon_h1      CacheList(ArraysCache, KVCache) x2: a Mamba2 mixer and attention in parallel
baichuan_m1    CacheList(ArraysCache, RotatingKVCache) + CacheList(ArraysCache, KVCache):
               a key/value conv state next to a sliding / global attention cache
deepseek_v32   CacheList(KVCache, KVCache) x2: the MLA cache and the sparse-attention
               indexer's key cache (index_topk 16, so the indexer really selects)
=============  ==========================================================================

Not covered: ``ConcatenateKVCache`` (only afm7 makes one, inside its forward when called
without a cache; ``make_prompt_cache`` never returns it), ``QuantizedKVCache`` (made by
``to_quantized`` on a KVCache, not by any model) and the ``Batch*`` caches (made by batch
generation). A cache class localchat does not know is not reachable through ``load_model``,
which resolves ``model_type`` from ``mlx_lm.models``; tests of that case monkeypatch
``make_prompt_cache`` / a model's ``make_cache`` to return a foreign object instead.

Weights: every matrix (Linear, Embedding, MoE expert stacks, conv kernels) is drawn from a
normal distribution with std 0.3 (``STD``), not the default init. With the default init
(std ~ 1/sqrt(fan_in) and small embeddings) a random model repeats one token whatever the
prompt, so an equivalence test between two cache paths would pass even if the cache were
wrong. With std 0.3 the greedy continuation depends on the context and stays finite (checked
for every family, seeds 0-5, by ``check_family``). Norm weights stay 1, biases and ``D`` keep
their model's own init. Exceptions, all in ``_randomize``: the SSM / gated-delta decay
(``A_log`` drawn so exp(A_log) is 0.01-0.1, ``dt_bias`` -2) is slowed down, else the
recurrent families forgot everything but the chat template's last few tokens and two
different prompts decoded the same; gpt-oss attention sinks get std 1 so that they matter;
baichuan-m1's key/value conv taps (zero at init, which zeroes keys and values) get std 0.3
around the identity tap, and its lm_head rows are saved unit-norm because its sanitize()
normalizes them at every load. lfm2 puts attention before its conv layer for the same reason
as the decay: with conv first the output hardly depended on earlier turns.

Every family gives the same logits (to ~1e-5) for a 150-token prompt fed at once, in uneven
chunks, or one token at a time, so cache-reuse equivalence tests can compare outputs closely;
deepseek_v32's top-k indexer and the MoE routers did not flip in 25 random prompts each.

Import mlx lazily (inside functions): the tests call ``localchat.cpu.backend.prepare()`` before
``mlx.core`` is first imported.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:  # importable from the repository root too
    sys.path.insert(0, str(Path(__file__).parent))

from tiny import CHATML, CORPUS, SPECIAL  # noqa: E402

STD = 0.3  # std of every random weight matrix; see the module docstring
WINDOW = 16  # sliding window / attention chunk size, in tokens
CONTEXT = 1024

_ATTN = {  # shared by the plain attention families
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

_MLA = {  # deepseek_v3 / deepseek_v32 multi-head latent attention, tiny
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
    "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False,
}

# family name -> config.json contents (vocab_size, eos_token_id, max_position_embeddings
# and the tokenizer are added by build_family).
FAMILIES: dict[str, dict] = {
    "llama": {"model_type": "llama", "num_hidden_layers": 2, **_ATTN},
    "qwen3": {"model_type": "qwen3", "num_hidden_layers": 2, **_ATTN},
    "deepseek_v3": {"model_type": "deepseek_v3", "num_hidden_layers": 2, **_MLA},
    "gemma3_text": {
        "model_type": "gemma3_text", "num_hidden_layers": 3, **_ATTN,
        "query_pre_attn_scalar": 16, "rope_local_base_freq": 10000.0,
        "sliding_window": WINDOW, "sliding_window_pattern": 3,  # layers 0, 1 sliding; 2 global
        "rope_scaling": None,
    },
    "gpt_oss": {
        "model_type": "gpt_oss", "num_hidden_layers": 2, **_ATTN, "intermediate_size": 64,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 150000,
        # YaRN like the real model (131072 / 4096 = 32 there; 1024 / 32 here)
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": CONTEXT // 32},
    },
    "llama4": {  # the text part of Llama 4: chunked attention on 3 of every 4 layers
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text", "num_hidden_layers": 4, **_ATTN,
            "intermediate_size_mlp": 128, "intermediate_size": 64,
            "attention_chunk_size": WINDOW, "attention_bias": False,
            "interleave_moe_layer_step": 4,  # layer 3 is MoE
            "num_local_experts": 2, "num_experts_per_tok": 1, "use_qk_norm": True,
            "rope_scaling": None,
        },
        "tie_word_embeddings": False,
    },
    "qwen3_next": {
        "model_type": "qwen3_next", "num_hidden_layers": 2, **_ATTN,
        "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,  # layer 0 linear attention, layer 1 full
        "num_experts": 0, "num_experts_per_tok": 1, "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 0, "mlp_only_layers": [],
        "moe_intermediate_size": 0, "partial_rotary_factor": 0.25, "rope_scaling": None,
    },
    "lfm2": {
        "model_type": "lfm2", "num_hidden_layers": 3, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "norm_eps": 1e-5,
        "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 128,
        "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False, "rope_theta": 10000.0,
        # attention first: with only a conv layer before the one attention layer, the
        # output barely depended on anything but the last few tokens for some seeds
        "layer_types": ["full_attention", "conv", "full_attention"],
        "tie_word_embeddings": True,
    },
    "mamba2": {
        "model_type": "mamba2", "num_hidden_layers": 2, "hidden_size": 64,
        "intermediate_size": 128, "num_heads": 8, "head_dim": 16, "state_size": 16,
        "n_groups": 1, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5, "time_step_limit": [0.0, 1e4], "time_step_rank": "auto",
        "tie_word_embeddings": False,
    },
    "falcon_h1": {
        "model_type": "falcon_h1", "num_hidden_layers": 2, **_ATTN,
        "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_chunk_size": WINDOW,
        "mamba_expand": 1, "mamba_rms_norm": True, "mamba_norm_before_gate": False,
        "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_use_mlp": True,
        "rope_theta": 10000.0, "tie_word_embeddings": False,
        # muP multipliers folded in by sanitize() only for HF weights; keep them neutral
        "attention_in_multiplier": 1.0, "attention_out_multiplier": 1.0,
        "embedding_multiplier": 1.0, "key_multiplier": 1.0, "lm_head_multiplier": 1.0,
        "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0,
        "mlp_multipliers": [1.0, 1.0], "ssm_multipliers": [1.0, 1.0, 1.0, 1.0, 1.0],
    },
    "baichuan_m1": {
        "model_type": "baichuan_m1", "num_hidden_layers": 2, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "conv_window": 2,
        "sliding_window": WINDOW, "sliding_window_layers": [0],  # layer 0 sliding, 1 global
        "tie_word_embeddings": False,
    },
    "deepseek_v32": {
        "model_type": "deepseek_v32", "num_hidden_layers": 2, **_MLA,
        "index_n_heads": 2, "index_head_dim": 16, "index_topk": WINDOW,
    },
}


@functools.lru_cache(maxsize=None)
def _tokenizer_json() -> str:
    """The trained tokenizer of tiny.py (same corpus, specials, vocabulary size), as JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str(pretty=True)  # byte-identical to tiny.py's tokenizer.json


# A reasoning model's template, as Qwen3's: an earlier reply is rendered without its
# ``<think>…</think>`` part; with thinking off the prompt ends in an empty thinking block, and
# ``opens`` (QwQ, DeepSeek-R1, Qwen3.5 style) puts ``<think>`` at the end of the prompt.
THINKING = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% elif OPENS %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)


def write_tokenizer(out: Path, *, context: int = CONTEXT,
                    thinking: str | None = None) -> tuple[int, int]:
    """Write tokenizer.json and tokenizer_config.json as tiny.py does; (vocab size, eos id).
    ``thinking``: "closed" or "opens" adds ``<think>``/``</think>`` (two more tokens) and the
    ``THINKING`` template, its prompt closed or opening the thinking."""
    from tokenizers import AddedToken, Tokenizer

    text = _tokenizer_json()
    template = CHATML
    if thinking:
        tok = Tokenizer.from_str(text)
        tok.add_special_tokens([AddedToken(t, special=True) for t in ("<think>", "</think>")])
        text = tok.to_str(pretty=True)
        template = THINKING.replace("OPENS", "true" if thinking == "opens" else "false")
    (out / "tokenizer.json").write_text(text)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": context, "chat_template": template,
    }))
    tok = Tokenizer.from_str(text)
    return tok.get_vocab_size(), tok.token_to_id("<|im_end|>")


def family_config(name: str, *, vocab_size: int, eos_token_id: int) -> dict:
    """The full config.json of a family."""
    config = copy.deepcopy(FAMILIES[name])
    common = {"vocab_size": vocab_size, "eos_token_id": eos_token_id,
              "max_position_embeddings": CONTEXT}
    config.update(common)
    if "text_config" in config:
        config["text_config"].update(common)
    return config


def _randomize(params: dict, *, std: float) -> dict:
    """Replace the weight matrices by N(0, std) draws; keep norms, SSM vectors and biases."""
    import mlx.core as mx

    out = {}
    for k, v in params.items():
        leaf = k.rsplit(".", 1)[-1]
        if leaf == "weight" and v.ndim >= 2:  # Linear, Embedding, expert stacks, conv kernels
            v = mx.random.normal(v.shape, dtype=mx.float32) * std
        elif leaf == "A_log":  # SSM / gated-delta decay rate: slow, to remember the context
            v = mx.log(mx.random.uniform(0.01, 0.1, v.shape))
        elif leaf == "dt_bias":  # smaller time steps, same reason
            v = mx.full(v.shape, -2.0)
        elif leaf == "sinks":  # gpt-oss per-head attention sink logits
            v = mx.random.normal(v.shape, dtype=mx.float32)
        elif leaf in ("conv_k", "conv_v"):  # baichuan-m1 taps [previous, current]; init 0
            v = mx.random.normal(v.shape, dtype=mx.float32) * std
            v = v + mx.array([0.0, 1.0])  # around the identity: current token's key / value
        out[k] = v
    return out


def build_family(name: str, out: Path, *, seed: int = 0, std: float = STD,
                 thinking: str | None = None) -> Path:
    """Write config.json, model.safetensors (float32) and the tokenizer files into out
    (``thinking``: a reasoning model's tokenizer and template, see ``write_tokenizer``)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab, eos = write_tokenizer(out, thinking=thinking)
    config = family_config(name, vocab_size=vocab, eos_token_id=eos)
    (out / "config.json").write_text(json.dumps(config, indent=1))

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    params = _randomize(dict(tree_flatten(model.parameters())), std=std)
    if name == "baichuan_m1":  # its sanitize() L2-normalizes lm_head rows at every load
        w = params["lm_head.weight"]
        params["lm_head.weight"] = w / mx.linalg.norm(w, axis=-1, keepdims=True)
    # Saved as the model's own parameter names: every family's sanitize() leaves these as
    # they are (it only rewrites Hugging Face layouts), so load_model(strict=True) takes them.
    weights = {k: v.astype(mx.float32) for k, v in params.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def cache_leaves(cache: list) -> list:
    """The leaves of a prompt cache list, each CacheList's parts flattened in order."""
    out = []

    def walk(obj):
        if type(obj).__name__ == "CacheList":
            for part in obj.caches:
                walk(part)
        else:
            out.append(obj)

    for c in cache:
        walk(c)
    return out


def cache_classes(folder: Path) -> list[str]:
    """Class names of make_prompt_cache(model)'s leaves for the model in folder."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(folder))
    return [type(c).__name__ for c in cache_leaves(make_prompt_cache(model))]


def greedy(model, prompt: list[int], steps: int = 16) -> list[int]:
    """Greedy continuation of prompt through a fresh prompt cache (prefill, then decode)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    out = []
    for _ in range(steps):
        if not bool(mx.all(mx.isfinite(logits)).item()):
            raise FloatingPointError("non-finite logits")
        tok = int(mx.argmax(logits, axis=-1).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[:, -1, :]
    return out


def check_family(folder: Path, steps: int = 16) -> dict:
    """Load folder and check that its output is finite and depends on the context.

    - greedy continuations (``steps`` tokens) after two different one-turn chat prompts
      differ, and neither is one token repeated;
    - the next-token logits after two three-turn conversations that differ only in their
      first user turn (the last ~60 tokens are the same) differ: the cache carries the
      early context.

    Raises AssertionError (or FloatingPointError) if not. Returns {"classes", "a", "b",
    "far"}: the cache leaf classes, the two continuations, and the largest logit difference
    of the second check.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(folder))
    tok = load_tokenizer(Path(folder))

    def render(*turns):
        roles = ["user", "assistant"] * len(turns)
        return tok.apply_chat_template([{"role": r, "content": t} for r, t in zip(roles, turns)],
                                       add_generation_prompt=True, tokenize=True)

    a = greedy(model, render("What is the capital of France?"), steps)
    b = greedy(model, render("안녕하세요. 오늘 날씨가 좋네요."), steps)
    if a == b:
        raise AssertionError(f"{folder}: output does not depend on the prompt: {a}")
    for seq in (a, b):
        if len(set(seq)) == 1:
            raise AssertionError(f"{folder}: constant output {seq}")

    last = ("Hello, how are you today? I am fine, thank you. Let us talk about caches. "
            "The capital of France is Paris.")
    logits = []
    for first in ("What is the capital of Korea?", "안녕하세요. 오늘 날씨가 좋네요."):
        out = model(mx.array([render(first, "It is Seoul.", last)]),
                    cache=make_prompt_cache(model))[0, -1]
        if not bool(mx.all(mx.isfinite(out)).item()):
            raise FloatingPointError(f"{folder}: non-finite logits")
        logits.append(out)
    far = float(mx.max(mx.abs(logits[0] - logits[1])).item())
    if far < 1e-2:
        raise AssertionError(f"{folder}: the first turn does not reach the last token ({far})")
    classes = [type(c).__name__ for c in cache_leaves(make_prompt_cache(model))]
    return {"classes": classes, "a": a, "b": b, "far": far}
