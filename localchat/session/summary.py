"""The model's summary of the messages that leave the window (``--context-overflow summarize``).

What it is: ``write_summary`` — one greedy generation outside the conversation: the model is
asked (``window.SUMMARY_SYSTEM``) to summarize a transcript of the last summary and the
messages leaving the window (``window.summary_request``), in the conversation's language, in
at most ``summary_tokens`` tokens, with its reasoning off where the template has the
switch. A transcript longer than the context keeps its end (the messages just before the
window). Its cache is thrown away: the summary enters the conversation through the rendered
system prompt (``window.with_summary``), and the turn prefills it there.

Progress: ``PrefillProgress`` of the transcript's prefill (a long one takes seconds), so the
front ends show it as they show a prompt's. What it is not: where the window moves
(``window.py``) or where the summary is kept (``store/database.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from ..errors import ContextFull
from ..events import PrefillProgress
from . import window
from .window import SUMMARY_SYSTEM, SUMMARY_TOKENS, summary_request


def write_summary(engine, earlier: str | None, leaving: list[dict],
                  stopped: Callable[[], bool] = lambda: False) -> Iterator:
    """Yields ``PrefillProgress``; returns the summary's text ("" if the model wrote none,
    or ``stopped()`` said so before it was done: the user stopped the turn)."""
    transcript = summary_request(earlier, leaving)
    if not transcript:
        return ""
    context = engine.info().context_length
    most = summary_tokens(context)
    room = context - most - 1
    tokens = _ask(engine, transcript)
    if len(tokens) > room:  # keep the transcript's end: what came just before the window
        over = len(tokens) - room
        ids = engine.encode(transcript)
        transcript = engine.decode_text(ids[min(len(ids), over + 16):])
        tokens = _ask(engine, transcript)
        if len(tokens) > room:
            return ""
    cache = engine.new_cache()
    steps = engine.prefill(tokens, cache)
    while True:
        try:
            done, total = next(steps)
        except StopIteration as fin:
            logits = fin.value
            break
        if stopped():
            return ""
        yield PrefillProgress(done, total)
    out = []
    eos = engine.eos_ids
    for tok in engine.decode(cache, logits, most):
        if tok in eos:
            break
        if stopped():
            return ""
        out.append(tok)
    return engine.decode_text(out).strip()


def summarize_cut(engine, history: list[dict], conv, summary: str | None, fitted, fit,
                  stopped):
    """``--context-overflow summarize`` at a cut (``Session._turn``): the model's summary of
    what is before the window ``fitted`` starts (the summary that stood for what came before,
    then the messages from there to the window), and the window refitted with it in the
    system prompt (``fit(at, summary, how)``).
    Yields the summary's progress; returns (the summary, or None if the model wrote
    none or the turn was stopped: the window then renders none; the fit)."""
    body = window.split(history, 0)[1]
    moved = fitted.moved
    for _ in range(3):  # (a long summary may push the window on: summarized again)
        since = conv.window_from if summary else 0
        text = yield from write_summary(engine, summary, body[since:fitted.window_from],
                                        stopped)
        if not text:
            break
        try:
            again = fit(fitted.window_from, text, "truncate")
        except ContextFull:  # (the summary leaves no room: the window goes without it)
            break
        if not again.moved:
            return text, dataclasses.replace(again, moved=moved)
        summary, conv, fitted, moved = text, dataclasses.replace(
            conv, window_from=fitted.window_from), again, True
    return None, dataclasses.replace(fit(fitted.window_from, None, "truncate"),
                                     moved=moved)


def summary_tokens(context: int) -> int:
    """The longest summary the model writes: ``SUMMARY_TOKENS``, at most an eighth of the
    context (it stays in every window after the cut)."""
    return max(16, min(SUMMARY_TOKENS, context // 8))


def _ask(engine, transcript: str) -> list[int]:
    return engine.render([{"role": "system", "content": SUMMARY_SYSTEM},
                          {"role": "user", "content": transcript}], thinking=False)
