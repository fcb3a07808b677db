"""Which tokens of an unsent message will not change as the user goes on typing.

What it is: draft prefill (``Drafts.prefill``, one part of a ``Session``): where the draft
ends in the rendered conversation, how many tokens before that end are stable, and their
prefill into the turn cache's memory (``TurnCache.live``). ``NoDrafts`` stands in where it
cannot work: a model split over ranks. What it is not: the app's timer (``tui/app.py``).

Tokenizers merge across the end of a word that is still growing ("hel" + "lo" → "hello"),
and the template puts the end of the message and the generation prompt after it. So a draft
prefills only the tokens whose text ends before its last word and the spaces before that word;
in a run of text without spaces longer than ``LONG_WORD`` characters (Chinese, Japanese, a
URL) only the last ``HOLD_CHARS`` are held back. This is a guess, never a risk: on Enter the
turn keeps only the prefilled tokens that equal its own rendering.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from ..events import DraftProgress
from ..kvcache import kinds as ck
from ..kvcache.folder import common_prefix
from ..store.database import Conversation
from . import window
from .conversations import Conversations
from .turncache import Live, TurnCache

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


# -- the prefill itself ---------------------------------------------------------------------

# A draft prefills this many tokens at a time, checking between chunks whether the user typed
# again (or sent it): ~0.25 s of the default model on a 2-core CPU.
DRAFT_CHUNK = 64
DRAFT_CHECKPOINTS = 3  # bounded states kept past the history's end while a draft grows


class Drafts:
    """Prefills the unsent message of a conversation into ``cache``'s memory."""

    def __init__(self, cache: TurnCache, conversations: Conversations):
        self.cache = cache
        self.engine = cache.engine
        self.conversations = conversations

    def prefill(self, conv: Conversation, text: str, cancel) -> Iterator[DraftProgress]:
        """Prefill the stable part of an unsent message into the conversation's cache in
        memory, so that the turn that sends it starts from there.

        Renders the conversation with ``text`` as a new user message, holds back what may
        still change (``stable_tokens``: the last word, the end of the message, the
        generation prompt) and prefills the rest after the cached history, ``DRAFT_CHUNK``
        tokens at a time, checking ``cancel`` between chunks. Nothing goes to the database or
        the disk. The next turn of ``conv`` keeps what matches its own rendering
        (``TurnCache.start``): an edit keeps the prefilled tokens before it, and the reply is
        the one it would be without a draft. A turn of another conversation or of another
        process drops it, and so does quitting. Nothing is done for a damaged or missing
        cache (the turn rebuilds it), a model whose cache is not kept, a template that
        rewrites the end of the history, or a message over the context.

        Not concurrently with a turn of the same session: the app runs both on its one MLX
        thread (``tui/mlxthread.py``).

        Yields:
            DraftProgress: first what is prefilled already, then after each chunk.
        """
        engine, turns = self.engine, self.cache
        if cancel.is_set() or not text.strip() or engine.info().unknown:
            return
        prior = turns.prior(conv, False, draft=True)
        if prior.note not in ("", "new conversation"):
            return
        messages = window.visible(window.with_summary(
            self.conversations.history(conv), window.summary_in_force(
                conv, conv.context_overflow or window.DEFAULT)), conv.window_from) + [
            {"role": "user", "content": text}]
        tokens = engine.render(messages, prior.tokens)
        on_disk = len(prior.tokens or ())
        if common_prefix(prior.tokens or [], tokens) < on_disk or \
                len(tokens) >= engine.info().context_length:
            return
        target = stable_tokens(engine, messages, tokens, on_disk)
        live = turns.live  # this conversation's (``prior`` dropped any other) or None

        def progress(fed: int) -> DraftProgress:
            return DraftProgress(max(0, min(fed, target) - on_disk), target - on_disk,
                                 len(tokens) - on_disk)

        if target == on_disk or (live and common_prefix(live.tokens, tokens) >= target):
            yield progress(target)
            return
        start = turns.start(conv, prior, tokens[:target], False, draft=True)
        if start.damaged:
            return
        turns.live = live = Live(conv.id, engine.cache_fingerprint, tokens[: start.pos],
                                 start.cache, dict(start.checkpoints), on_disk)
        yield progress(start.pos)
        bounded = bool(ck.bounded(live.cache))
        # Bounded caches get checkpoints as the draft grows (an edit goes back to one), and
        # one at the history's end when resumed before it.
        ends = [on_disk] if bounded and start.pos < on_disk else []
        for end in ends + [target]:
            first = len(live.tokens)
            steps = engine.prefill(tokens[first:end], live.cache, DRAFT_CHUNK,
                                   **({"before": tokens[:first]} if engine.takes_images()
                                      else {}))
            while not cancel.is_set():
                try:
                    done, _ = next(steps)
                except StopIteration:
                    done = end - first
                except BaseException:
                    turns.live = None  # stopped inside a model step: the cache is unknown
                    raise
                live.tokens = tokens[: first + done]
                if bounded and (len(live.tokens) > on_disk or len(live.tokens) == end):
                    keep_draft_checkpoint(live)
                if len(live.tokens) == end:
                    break
                yield progress(len(live.tokens))
            steps.close()
            if cancel.is_set():
                break
        yield progress(len(live.tokens))


class NoDrafts:
    """``Drafts`` where it cannot work (a model split over ranks): nothing is prefilled."""

    def prefill(self, conv: Conversation, text: str, cancel) -> Iterator[DraftProgress]:
        return iter(())


def keep_draft_checkpoint(live: Live) -> None:
    """Capture the bounded state where the draft now ends. Kept: the history's checkpoints,
    and past them the newest ``DRAFT_CHECKPOINTS`` at least 8 tokens apart (not all at the
    last few words typed), so that an edit restores a state near it."""
    pos = len(live.tokens)
    live.checkpoints[pos] = ck.capture(live.cache, pos)
    kept: list[int] = []
    for q in sorted((q for q in live.checkpoints if q > live.on_disk), reverse=True):
        if len(kept) < DRAFT_CHECKPOINTS and (not kept or kept[-1] - q >= 8):
            kept.append(q)
        else:
            del live.checkpoints[q]
