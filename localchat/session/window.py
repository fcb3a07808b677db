"""The context as a window over the stored conversation: what a turn renders when it is full.

What it is: ``fit`` — the token ids a turn prefills and its reply budget, for a conversation
whose window leaves out its first ``window_from`` messages (the system prompt aside). When the
window plus a reply budget no longer fits the model's context, the policy decides:

- ``truncate`` (the default): the window moves past the oldest whole turns — it starts at a
  user message, so a reply and its tool calls and results leave together — in one large step:
  to the first turn from which the rendered window is at most half the context. The turns
  after the cut render the same window plus new messages, so they append to the cache; the
  next cut comes only when the window fills the context again.
- ``summarize``: the window moves as with ``truncate``, and the model writes a summary of
  everything before it (the last summary and the messages leaving now, ``summary_request``),
  which is rendered at the end of the system prompt (``with_summary``) and kept with the
  conversation (``summary``, ``summary_upto``: the window start it stands for; shown by
  ``show``, the app's window marker, replaced by ``localchat summary NAME --set``). The turns
  after the cut render the same summary, so they append to the cache as after a truncate.
- ``stop``: refuse (``ContextFull``), with the hint to fork or switch the policy.

The system prompt always stays. Stored messages never change; only what is rendered does, and
the cache after a cut is an exact cache of the new window (the turn prefills it; the prefix
match keeps what still matches, the system prompt). What it is not: the conversation's rows
(``store/database.py``), the cache (``turncache.py``) or the summary's generation (``session.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadInput, ContextFull

POLICIES = ("truncate", "summarize", "stop")
DEFAULT = "truncate"
SERVE_POLICIES = ("truncate", "stop")  # (a client re-sends its history: no summary stands in)

# The summary's place in the rendered conversation: at the end of the system prompt.
SUMMARY_HEAD = "Summary of the earlier conversation (no longer shown in full):"
SUMMARY_TOKENS = 256  # the longest summary the model writes
# What the model is asked when it summarizes (the transcript follows as the user's message).
SUMMARY_SYSTEM = ("You summarize conversations. Write a short summary of the conversation you "
                  "are given: the facts, names, numbers, decisions and open questions, in the "
                  "language the conversation is written in. Write only the summary.")


@dataclass(frozen=True)
class Fitted:
    """What a turn renders: its tokens, its reply budget and the window it used."""

    tokens: list[int]
    max_tokens: int
    window_from: int  # stored messages (system aside) left out of the window
    moved: bool  # this turn moved the window (a cut: the cache is rebuilt from the cut)

    def notice(self, summarized: bool = False) -> str:
        """The miss reason of a turn that moved the window."""
        n = self.window_from
        return (f"context full: {n} earlier message{'s' if n != 1 else ''} "
                + ("summarized" if summarized else "left out"))


def policy_of(name: str | None) -> str:
    """A policy name checked (None: the default). Raises BadInput naming the choices."""
    if name is None:
        return DEFAULT
    if name not in POLICIES:
        raise BadInput(f"--context-overflow must be one of {', '.join(POLICIES)}, not {name!r}")
    return name


def summary_in_force(conv, policy: str) -> str | None:
    """The summary a turn of ``conv`` renders: under ``summarize``, the one made for the
    window as it stands (a window moved since, by another policy or a fork, has none)."""
    summary, upto = conv.summary, conv.summary_upto
    if policy != "summarize" or not conv.window_from or not isinstance(summary, str) or \
            not summary.strip() or type(upto) is not int:  # (a damaged row: no summary)
        return None
    return summary if upto == conv.window_from else None


def with_summary(history: list[dict], summary: str | None) -> list[dict]:
    """``history`` with ``summary`` at the end of its system prompt (one made if none)."""
    if not summary:
        return history
    said = f"{SUMMARY_HEAD}\n{summary}"
    if history and history[0]["role"] == "system":
        first = history[0].get("content") or ""
        return [{**history[0], "content": f"{first}\n\n{said}" if first else said},
                *history[1:]]
    return [{"role": "system", "content": said}, *history]


def summary_request(earlier: str | None, leaving: list[dict]) -> str:
    """The transcript the model summarizes: the summary that stood for what came before,
    then the messages leaving the window (tool results and calls as their text)."""
    parts = [f"(Summary of what came before: {earlier})"] if earlier else []
    for m in leaving:
        text = (m.get("content") or "").strip()
        if text:
            parts.append(f"{m['role']}: {text}")
    return "\n\n".join(parts)


def reply_budget(max_tokens: int, context: int) -> int:
    """Room a window keeps for the reply: the reply cap, at most a quarter of the context
    (a long cap must not leave a window of a few messages; the reply may still run on into
    whatever room the window leaves)."""
    return max(1, min(max_tokens, context // 4))


def split(history: list[dict], window_from: int) -> tuple[list[dict], list[dict], int]:
    """(the system prompt as a list, the rest, the window's start in the rest): the start
    moved back to a user message when an edit or regenerate removed messages after it."""
    head = history[:1] if history and history[0]["role"] == "system" else []
    body = history[len(head):]
    users = [i for i, m in enumerate(body) if m["role"] == "user"]
    start = min(window_from, users[-1]) if users else 0
    if start and start not in users:
        start = next((u for u in users if u >= start), users[-1])
    return head, body, start


def visible(history: list[dict], window_from: int) -> list[dict]:
    """What the model sees of ``history`` (the system prompt, then the window) as it stands:
    a draft's or the cache view's rendering, before any cut the next turn may make."""
    head, body, start = split(history, window_from)
    return head + body[start:]


def fit(render, context: int, history: list[dict], window_from: int, policy: str,
        max_tokens: int, name: str) -> Fitted:
    """The window of ``history`` a turn renders.

    Args:
        render: ``messages -> token ids`` (the engine's render with the turn's options).
        context: the model's context length. name: the model's name, for messages.
        history: the whole stored conversation plus the new messages, system prompt first.
        window_from: the conversation's current window start (messages, system aside).
        policy: ``truncate``, ``summarize`` (cut as ``truncate``: the caller writes the
            summary) or ``stop``.
    Raises:
        ContextFull: ``stop`` and the window does not fit, or the last turn alone does not.
    """
    head, body, start = split(history, window_from)
    users = [i for i, m in enumerate(body) if m["role"] == "user"]
    tokens = render(head + body[start:])
    budget = reply_budget(max_tokens, context)
    cuts = policy != "stop"
    if len(tokens) + (budget if cuts else 1) <= context:
        return Fitted(tokens, min(max_tokens, context - len(tokens)), start, False)
    if not cuts:
        raise ContextFull(
            f"the conversation is {len(tokens)} tokens; {name} holds {context}: fork it, "
            "shorten the message, or switch --context-overflow to truncate")
    # Later starts render shorter windows: the first that is at most half the context (a
    # large step), else the first that fits at all.
    later = [u for u in users if u > start]
    sizes: dict[int, int] = {}

    def size(u: int) -> int:
        if u not in sizes:
            sizes[u] = len(render(head + body[u:]))
        return sizes[u]

    for limit in (context // 2, context - budget, None):
        if limit is None:
            # Nothing leaves room for the whole budget: a window that fits at all takes the
            # room there is (the current one first: a cut that gains no budget is no use).
            if len(tokens) < context:
                return Fitted(tokens, context - len(tokens), start, False)
            limit = context - 1
        found = _first(later, lambda u, limit=limit: size(u) <= limit)
        if found is not None:
            tokens = render(head + body[found:])
            return Fitted(tokens, min(max_tokens, context - len(tokens)), found, True)
    last = size(users[-1]) if users else len(tokens)
    raise ContextFull(
        f"the last message alone is {last} tokens; {name} holds {context}: shorten the "
        "message")


def _first(items: list[int], ok) -> int | None:
    """The first of ``items`` for which ``ok`` holds, given that it holds for every item after
    one that does (binary search: each test renders a window)."""
    lo, hi = 0, len(items)
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(items[mid]):
            hi = mid
        else:
            lo = mid + 1
    return items[lo] if lo < len(items) else None
