"""Where a reply ends, and which tokens are never reply text.

What it is: ``end_tokens`` — the model's end-of-generation set, built as llama.cpp builds its
EOG list: the tokenizer's EOS ids (config.json's ``eos_token_id`` included, as mlx-lm loads
them), every id of ``generation_config.json``'s ``eos_token_id`` (an int or a list), and the
special tokens of the vocabulary that end a turn or a document (``<|endoftext|>``,
``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``<|return|>``, …). Also the control tokens
(added tokens flagged special) a reply never shows or stores, except those the reply's own
parsers read (reasoning and tool-call markers). What it is not: sampling (``defaults.py``) or
the decode loop (``engine.py``, ``session/generation.py``).

Why the extra ends: SmolLM2 names ``<|im_end|>`` its EOS but also writes ``<|endoftext|>`` at
the end of a reply; stopping on the EOS alone ran one reply to the end of the context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The texts of end-of-turn / end-of-document specials (llama.cpp's EOG list and the chat
# formats we know). Only tokens of the vocabulary that are added/special count: a word piece
# that happens to read "</s>" in a plain vocabulary is text.
END_TEXTS = (
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|return|>",
    "<|call|>", "<|end|>", "</s>", "<|end_of_text|>", "<EOT>", "_<EOT>", "<|EOT|>",
    "<｜end▁of▁sentence｜>", "<|end▁of▁sentence|>", "<end_of_utterance>",
    "<|END_OF_TURN_TOKEN|>", "<|endofturn|>", "<|im_end_of_turn|>",
)


# gpt-oss's framing of a reply: its analysis channel, then the final one (``replies.py`` splits
# a reply there; ``<|end|>`` inside it is not the end of the reply).
HARMONY = ("<|channel|>analysis<|message|>",
           "<|end|><|start|>assistant<|channel|>final<|message|>")


def parser_markers(tokenizer) -> tuple[str, ...]:
    """The marker strings a reply's parsers read (reasoning, tool calls, gpt-oss's channels),
    from mlx-lm's tokenizer wrapper: the special tokens inside them stay reply text."""
    found: list[str] = []
    if getattr(tokenizer, "has_thinking", False):
        found += [tokenizer.think_start, tokenizer.think_end]
    if getattr(tokenizer, "has_tool_calling", False):
        found += [tokenizer.tool_call_start, tokenizer.tool_call_end]
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, TypeError):
        vocab = {}
    if "<|channel|>" in vocab and "<|message|>" in vocab:
        found += list(HARMONY)
    return tuple(m for m in found if isinstance(m, str) and m)


@dataclass(frozen=True)
class EndTokens:
    """A model's end-of-generation ids and the control ids a reply never holds as text."""

    ends: frozenset[int]  # the reply ends at any of these (not fed, not text)
    hidden: frozenset[int]  # special tokens dropped from a reply's text (``ends`` included)
    sources: tuple[str, ...] = ()  # where the ends came from, for ``inspect``


def end_tokens(tokenizer, folder: Path | None, keep_texts: tuple[str, ...] = ()) -> EndTokens:
    """The end-of-generation set of a model.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` (its ``eos_token_ids`` and the wrapped
            tokenizer's added tokens are read).
        folder: the model folder (``generation_config.json``), or None.
        keep_texts: marker strings the reply parsers read (``<think>``, gpt-oss's channel
            framing, ``<tool_call>``): a special token inside one of them is not hidden and,
            when it frames a reply's parts (gpt-oss's ``<|end|>``), not an end either.
    Returns:
        EndTokens; malformed ``generation_config.json`` ids are ignored (the others stand).
    """
    ends: set[int] = set(getattr(tokenizer, "eos_token_ids", None) or [])
    sources = ["tokenizer EOS"] if ends else []
    extra = _generation_config_eos(folder)
    if extra - ends:
        sources.append("generation_config.json")
    ends |= extra
    specials = _special_tokens(tokenizer)
    kept = {i for i, text in specials.items() if any(text in k for k in keep_texts)}
    named = {i for i, text in specials.items() if text in END_TEXTS and i not in kept}
    if named - ends:
        sources.append("end-of-turn specials")
    ends |= named
    ends -= kept
    hidden = (set(specials) - kept) | ends
    return EndTokens(frozenset(ends), frozenset(hidden), tuple(sources))


def _generation_config_eos(folder: Path | None) -> set[int]:
    """``eos_token_id`` of ``generation_config.json`` (an int or a list of ints); anything else
    there (a string, a negative id, a broken file) adds nothing."""
    if folder is None:
        return set()
    try:
        value = json.loads((Path(folder) / "generation_config.json").read_text()).get(
            "eos_token_id")
    except (OSError, ValueError, AttributeError):
        return set()
    values = value if isinstance(value, list) else [value]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def _special_tokens(tokenizer) -> dict[int, str]:
    """The added tokens flagged special, by id (both tokenizer paths expose the backend)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is not None:
        try:
            return {int(i): t.content for i, t in backend.get_added_tokens_decoder().items()
                    if t.special}
        except AttributeError:
            pass  # an older tokenizers release: the named specials below
    ids = getattr(inner, "all_special_ids", None) or []
    try:
        return {int(i): inner.convert_ids_to_tokens(int(i)) for i in ids}
    except (AttributeError, TypeError, ValueError):
        return {}
