"""The status bar: model, context use, the draft's prefill, the last turn's cache hit and speed.

Everything it shows comes from the ``Usage`` record a turn returns and the ``DraftProgress``
of the unsent message (data down).
"""

from __future__ import annotations

from textual.reactive import reactive
from textual.widgets import Static

from ..events import DraftProgress, Usage
from ..fmt import human_bytes, visible


def describe(usage: Usage) -> str:
    """The last-turn part of the status bar, e.g. 'cached 380 / prefilled 32 (92% hit)'."""
    parts = [
        f"cached {usage.cached_tokens} / prefilled {usage.prefilled_tokens} "
        f"({usage.hit_ratio:.0%} hit)",
        *([f"draft {usage.draft_tokens}"] if usage.draft_tokens else []),
        f"gen {usage.completion_tokens}" + (f" (thinking {usage.reasoning_tokens})"
                                            if usage.reasoning_tokens else ""),
        f"TTFT {usage.ttft_s:.2f}s",
        f"prefill {usage.prefill_tps:.0f} tok/s",
        f"decode {usage.decode_tps:.1f} tok/s",
        f"KV {human_bytes(usage.cache_bytes)}",
    ]
    if usage.checkpoints:
        parts.append("checkpoints")
    if usage.miss_reason:
        parts.append(f"miss: {usage.miss_reason}")
    return " · ".join(parts)


def describe_draft(p: DraftProgress) -> str:
    """E.g. 'draft 812/830 prefilled': tokens of the unsent message prefilled so far, of the
    tokens it adds (its last word and the template's end are held back until Enter)."""
    if not p.target:
        return ""
    return f"draft {p.done}/{p.total} " + ("prefilled" if p.ready else "prefilling…")


class StatusBar(Static):
    """Model names and miss reasons come from files and people: drawn literally."""

    model: reactive[str] = reactive("loading model…")
    context: reactive[tuple[int, int]] = reactive((0, 0))
    last_turn: reactive[str] = reactive("")
    activity: reactive[str] = reactive("")  # prefill progress, model set-up
    draft: reactive[str] = reactive("")  # the unsent message's prefill (describe_draft)
    usage: Usage | None = None  # the last turn's figures (what ``last_turn`` shows)

    def __init__(self, **kw):
        super().__init__(markup=False, **kw)

    def render(self) -> str:
        used, length = self.context
        parts = [self.model]
        if length:
            parts.append(f"ctx {used}/{length}")
        if self.draft and not self.activity:
            parts.append(self.draft)
        if self.activity:
            parts.append(self.activity)
        elif self.last_turn:
            parts.append(self.last_turn)
        return visible(" · ".join(parts))

    def show_usage(self, usage: Usage) -> None:
        self.usage = usage  # the last turn's figures, as shown
        self.context = (usage.context_tokens, usage.context_length)
        self.last_turn = describe(usage)
        self.activity = ""
