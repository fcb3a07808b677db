"""The status bar: the last turn's cache hit, TTFT and speed first, then the rest that fits;
while a reply streams, the reply itself (tokens so far, tok/s, thinking tokens).

Everything it shows comes from the ``Usage`` record a turn returns, the counts the streamed
chunks carry and the ``DraftProgress`` of the unsent message (data down). The bar is one line:
each part has a rank, and what does not fit the width is dropped least useful first (at 80
columns: the hit, TTFT and decode speed stay; the model name, context and byte counts go
first), never cut mid-figure. Near the end of the context its share stays (``context 74%``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.cells import cell_len
from textual.reactive import reactive
from textual.widgets import Static

from ..events import DraftProgress, Usage
from ..fmt import human_bytes, visible

SEP = " · "
# From this share of the context on, the bar says how full it is and keeps saying it at any
# width: soon the oldest turns leave the window (``truncate``; with the app's 2,048-token reply
# cap the default model's window moves once it passes 75% of 8,192) or a turn is refused
# (``stop``). Korean fills it ~4.7x faster than English (docs/app.md, "The status bar").
NEAR = 0.7


@dataclass(frozen=True)
class Part:
    text: str
    rank: int  # 0: kept longest; higher ranks are dropped first when the bar is too narrow
    short: str = ""  # said instead of being dropped (then kept as rank 0)


def usage_parts(usage: Usage) -> list[Part]:
    """The last turn's figures, in the order shown."""
    hit = f"{usage.hit_ratio:.0%} hit"
    parts = [
        Part(f"cached {usage.cached_tokens} / prefilled {usage.prefilled_tokens} ({hit})", 2,
             short=hit),
        Part(f"TTFT {usage.ttft_s:.2f}s", 0),
        Part(f"decode {usage.decode_tps:.1f} tok/s", 0),
        *([Part(f"miss: {usage.miss_reason}", 1)] if usage.miss_reason else []),
        Part(f"gen {usage.completion_tokens}" + (f" (thinking {usage.reasoning_tokens})"
                                                 if usage.reasoning_tokens else ""), 3),
        *([Part(f"draft {usage.draft_tokens}", 7)] if usage.draft_tokens else []),
        Part(f"prefill {usage.prefill_tps:.0f} tok/s", 6),
        Part(f"KV {human_bytes(usage.cache_bytes)}", 8),
        *([Part("checkpoints", 9)] if usage.checkpoints else []),
    ]
    if usage.blas_threads:  # fewer BLAS threads than cores: other processes hold some
        parts.append(Part(usage.blas_threads, 11, short=usage.blas_threads.split(":")[0]))
    if usage.lookup_drafted:  # prompt lookup (``session/speculative.py``): drafts the model took
        parts.append(Part(f"lookup {usage.lookup_accepted}/{usage.lookup_drafted} taken", 10))
    return parts


def context_part(used: int, length: int) -> Part:
    """``ctx 812/8192``, dropped early on a narrow bar; near the limit ``context 74%``, kept."""
    if used >= NEAR * length:
        return Part(f"context {100 * used // length}%", 0)
    return Part(f"ctx {used}/{length}", 4)


def describe(usage: Usage) -> str:
    """The last-turn part of the status bar, whole, e.g. '92% hit · TTFT 0.12s · …'."""
    return SEP.join(p.text for p in usage_parts(usage))


def describe_draft(p: DraftProgress) -> str:
    """E.g. 'draft 812/830 prefilled': tokens of the unsent message prefilled so far, of the
    tokens it adds (its last word and the template's end are held back until Enter)."""
    if not p.target:
        return ""
    return f"draft {p.done}/{p.total} " + ("prefilled" if p.ready else "prefilling…")


def describe_reply(generated: int, thinking: int, tok_s: float) -> list[Part]:
    """A reply as it streams, e.g. 'replying: 57 tokens · 12.3 tok/s · thinking 20'."""
    return [Part(f"replying: {generated} tokens", 0),
            *([Part(f"{tok_s:.1f} tok/s", 0)] if tok_s else []),
            *([Part(f"thinking {thinking}", 1)] if thinking else [])]


def fit(parts: list[Part], width: int) -> str:
    """``parts`` joined, dropping the highest rank (the later one among equals; one with a
    short form is shortened instead) until the line fits ``width`` cells; what the most
    useful parts alone overflow is cut by the widget."""
    shown = list(parts)
    while len(shown) > 1 and cell_len(SEP.join(p.text for p in shown)) > width:
        worst = max(range(len(shown)), key=lambda i: (shown[i].rank, i))
        if shown[worst].rank == 0:
            break
        if shown[worst].short:
            shown[worst] = Part(shown[worst].short, 0)
        else:
            del shown[worst]
    return SEP.join(p.text for p in shown)


class StatusBar(Static):
    """Model names and miss reasons come from files and people: drawn literally."""

    model: reactive[str] = reactive("loading model…")
    context: reactive[tuple[int, int]] = reactive((0, 0))
    last_turn: reactive[str] = reactive("")  # before any turn: what the conversation holds
    activity: reactive[str] = reactive("")  # prefill progress, model set-up
    draft: reactive[str] = reactive("")  # the unsent message's prefill (describe_draft)
    reply: reactive[tuple[int, int, float]] = reactive((0, 0, 0.0))  # generated, thinking, tok/s
    replying: reactive[bool] = reactive(False)  # a turn runs: the last turn's figures are old
    usage: reactive[Usage | None] = reactive(None)  # the last turn's figures

    def __init__(self, **kw):
        super().__init__(markup=False, **kw)
        self._first: tuple[int, float] | None = None  # the reply's first count and its time

    def parts(self) -> list[Part]:
        """Everything the bar could show now, in order."""
        used, length = self.context
        figures = self.usage is not None or self.replying
        # The model's name is known from the start: first until a turn has figures, then the
        # first thing a narrow bar does without.
        out = [] if figures else [Part(self.model, 0)]
        if self.activity:
            out.append(Part(self.activity, 0))
        if self.replying:
            if self.reply[0]:
                out += describe_reply(*self.reply)
        elif self.usage is not None:
            out += usage_parts(self.usage)
        elif self.last_turn:
            out.append(Part(self.last_turn, 2))
        if length:
            out.append(context_part(used, length))
        if self.draft and not self.activity:
            out.append(Part(self.draft, 1))
        if figures:
            out.append(Part(self.model, 5))
        return out

    def render(self) -> str:
        return visible(fit(self.parts(), self.content_size.width or 80))

    def show_usage(self, usage: Usage) -> None:
        """The turn ended: its figures replace the streaming reply's."""
        self.usage = usage
        self.context = (usage.context_tokens, usage.context_length)
        self.replying = False
        self.activity = ""

    def show_stored(self, tokens: int) -> None:
        """Another conversation is open: what its cache holds, no turn's figures yet."""
        self.usage = None
        self.replying = False
        self.last_turn = f"{tokens} tokens cached on disk" if tokens else ""

    def begin_reply(self) -> None:
        """A turn starts: the previous turn's figures go (they are not this reply's)."""
        self.replying = True
        self.reply = (0, 0, 0.0)
        self._first = None

    def reply_grew(self, generated: int, thinking: int, at: float | None = None) -> None:
        """``generated`` tokens so far (``thinking`` of them reasoning), the newest at
        ``at`` (``time.perf_counter``); the speed counts from the first one seen."""
        at = time.perf_counter() if at is None else at
        if self._first is None:
            self._first = (generated, at)
        n0, t0 = self._first
        rate = (generated - n0) / (at - t0) if generated > n0 and at > t0 else 0.0
        self.reply = (generated, thinking, rate)
        self.activity = ""
