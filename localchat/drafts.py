"""Which tokens of an unsent message will not change as the user goes on typing.

What it is: the text side of draft prefill (``Session.prefill_draft``): where the draft ends
in the rendered conversation, and how many tokens before that end are stable. What it is not:
the prefill itself (``session.py``) or the app's timer (``tui/app.py``).

Tokenizers merge across the end of a word that is still growing ("hel" + "lo" → "hello"),
and the template puts the end of the message and the generation prompt after it. So a draft
prefills only the tokens whose text ends before its last word and the spaces before that word;
in a run of text without spaces longer than ``LONG_WORD`` characters (Chinese, Japanese, a
URL) only the last ``HOLD_CHARS`` are held back. This is a guess, never a risk: on Enter the
turn keeps only the prefilled tokens that equal its own rendering.
"""

from __future__ import annotations

import re

LONG_WORD = 48  # characters without a space after which a draft holds back less than a word
HOLD_CHARS = 16
MARK = "\u2063localchat-draft\u2063"  # stands for the draft when locating it in the template

_LAST_WORD = re.compile(r"\S+\Z")


def stable_chars(draft: str) -> int:
    """How many leading characters of ``draft`` later typing is unlikely to retokenize."""
    body = draft.rstrip()
    m = _LAST_WORD.search(body)
    start = m.start() if m else len(body)
    if len(body) - start > LONG_WORD:
        return len(body) - HOLD_CHARS
    return len(body[:start].rstrip())


def draft_span(tokenizer, messages: list[dict]) -> tuple[int, int] | None:
    """(start, end) of the last message's text in the rendered conversation, or None when
    the template does not show it as it is (it rewrites message texts).

    The template is rendered twice, with the draft and with ``MARK`` in its place: what
    surrounds the mark is what surrounds the draft.
    """
    def render(msgs: list[dict]) -> str:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    text = render(messages)
    marked = render(messages[:-1] + [{**messages[-1], "content": MARK}])
    at = marked.find(MARK)
    if at < 0:
        return None
    head, tail = marked[:at], marked[at + len(MARK):]
    end = len(text) - len(tail)
    if not (text.startswith(head) and text.endswith(tail) and end >= len(head)):
        return None
    if text[len(head):end].strip() != messages[-1]["content"].strip():
        return None
    return len(head), end


def stable_tokens(engine, messages: list[dict], tokens: list[int], lo: int = 0) -> int:
    """How many leading ``tokens`` (the rendering of ``messages``, the draft last) a draft
    prefills: those whose text ends within the draft's stable part.

    Args:
        engine: an ``Engine`` (its tokenizer renders and decodes).
        lo: a count known to qualify (the history's tokens); the answer is at least that.
    """
    span = draft_span(engine.tokenizer, messages)
    if span is None:
        return lo
    start, end = span
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=False)
    limit = text[: start + stable_chars(text[start:end])]

    # The longest prefix of tokens whose text is a prefix of ``limit`` (binary search). Ids
    # that end inside a character (byte-level pieces of Korean) decode to U+FFFD: dropped,
    # what comes before still says whether the ids are within the limit.
    hi = len(tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if limit.startswith(engine.decode_text(tokens[:mid]).rstrip("\ufffd")):
            lo = mid
        else:
            hi = mid - 1
    return lo
