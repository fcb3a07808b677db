"""Tokenizer folders shaped like the published ones of the families people run, built offline.

The Hub is out of reach and the registry's packages carry only SmolLM2's files (inside the
default model's GGUF), so each family here is its published chat template
(``tests/data/chat_templates/``: SmolLM2's is the real one, the others written from the
published files) with the family's special tokens, named tokens and tokenizer shape (byte-level
BPE like GPT-2/Llama 3/Qwen, or SentencePiece-style BPE with byte fallback like Llama 2,
Mistral, Phi-3 and Gemma), trained here on a small English/Korean/code corpus: a few hundred
tokens instead of a 150k vocabulary, the same pipeline.

``build(family, folder, plain=True)`` writes tokenizer.json, tokenizer_config.json and
config.json; ``plain=False`` keeps the family's own tokenizer class and model type (which
transformers treats its own way: ``localchat.model.tokenizer.check``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"

CORPUS = [
    "The museum opens at nine and the guided tour starts at ten.",
    "서울의 날씨는 오늘 맑고 따뜻합니다. 다음 주에는 부산에 가서 바다를 볼 계획입니다.",
    "def main():\n    print('hello world')\n    return 0\n",
    "We discussed the budget, the schedule and who will book the train tickets. 👍🎉",
    '{"name": "get_weather", "arguments": {"city": "Seoul", "unit": "celsius"}}',
    "Can you help me?  Sure!\tTabs,\r\nnewlines and    spaces. 1234567890 <b>bold</b>",
]


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # file in TEMPLATES
    shape: str  # "bytes" (byte-level BPE), "spm" (Llama 2: strip the first space), "gemma"
    tokens: tuple[str, ...]  # added special tokens, in id order after the vocabulary
    named: dict = field(default_factory=dict)  # bos_token, eos_token, … -> token
    cls: str = "PreTrainedTokenizerFast"  # the published tokenizer class
    model_type: str = "llama"
    markers: tuple[str, ...] = ()  # added tokens that are not special (<think>, <tool_call>)
    extra: dict = field(default_factory=dict)  # other tokenizer_config keys


FAMILIES = {f.name: f for f in [
    Family("smollm2", "smollm2.jinja", "bytes",
           ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
           {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
            "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, cls="GPT2Tokenizer"),
    Family("qwen3", "qwen3.jinja", "bytes",
           ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
           {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, cls="Qwen2Tokenizer",
           model_type="qwen3",
           markers=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                    "<think>", "</think>"),
           extra={"errors": "replace", "split_special_tokens": False}),
    Family("llama3", "llama3.jinja", "bytes",
           ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
           {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
           extra={"model_input_names": ["input_ids", "attention_mask"]}),
    Family("gemma3", "gemma3.jinja", "gemma",
           ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
            "<start_of_image>"),
           {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
            "unk_token": "<unk>", "boi_token": "<start_of_image>"}, cls="GemmaTokenizer",
           model_type="gemma3_text", extra={"add_bos_token": True, "add_eos_token": False}),
    Family("mistral", "mistral.jinja", "spm",
           ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
           {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
           cls="LlamaTokenizer", model_type="mistral", extra={"legacy": False}),
    Family("gpt_oss", "gpt_oss.jinja", "bytes",
           ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
            "<|start|>", "<|end|>", "<|message|>", "<|call|>"),
           {"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
            "pad_token": "<|endoftext|>"}, model_type="gpt_oss"),
    Family("deepseek_r1", "deepseek_r1.jinja", "bytes",
           ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"),
           {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
            "pad_token": "<｜end▁of▁sentence｜>"}, cls="LlamaTokenizerFast",
           model_type="deepseek_v3", markers=("<think>", "</think>")),
    Family("phi4", "phi4.jinja", "bytes",
           ("<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"),
           {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
           cls="GPT2Tokenizer", model_type="phi3"),
    Family("phi3", "phi3.jinja", "spm",
           ("<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>"),
           {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>",
            "pad_token": "<|endoftext|>"}, cls="LlamaTokenizer", model_type="phi3"),
]}


def template(family: str) -> str:
    return (TEMPLATES / FAMILIES[family].template).read_text(encoding="utf-8")


def _bytes_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Llama 3's / Qwen's split, then GPT-2's byte mapping
    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
             r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def _spm_tokenizer(strip_first_space: bool):
    """SentencePiece-style BPE: ``▁`` for spaces, byte fallback (``<0xEC>``), unk id 0."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    raw.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=500,
                                                            show_progress=False))
    trained = json.loads(raw.to_str())["model"]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    vocab = {p: i for i, p in enumerate(pieces)}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) if isinstance(m, list)
                                                    else tuple(m.split(" "))
                                                    for m in trained["merges"]],
                               unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if strip_first_space:  # Llama 2, Mistral, Phi-3
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                 decoders.Strip(" ", 1, 0)]
    else:  # Gemma
        tok.normalizer = normalizers.Replace(" ", "▁")
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps)
    return tok


def build(family: str, folder: Path, *, plain: bool = True) -> Path:
    """A tokenizer folder of ``family`` (see the module docstring)."""
    from tokenizers import AddedToken

    f = FAMILIES[family]
    folder.mkdir(parents=True, exist_ok=True)
    tok = _bytes_tokenizer() if f.shape == "bytes" else _spm_tokenizer(f.shape == "spm")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in f.tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in f.markers])
    tok.save(str(folder / "tokenizer.json"))
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip,
                      "normalized": t.normalized, "single_word": t.single_word,
                      "special": t.special}
             for i, t in tok.get_added_tokens_decoder().items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast" if plain else f.cls,
              "added_tokens_decoder": added, "chat_template": template(family),
              "clean_up_tokenization_spaces": False, "model_max_length": 4096,
              **f.named, **f.extra}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    model_type = f.model_type
    if plain and model_type in ("phi3", "qwen2"):  # (transformers picks a class for these)
        model_type = "llama"
    (folder / "config.json").write_text(json.dumps({"model_type": model_type,
                                                    "max_position_embeddings": 4096}))
    return folder
