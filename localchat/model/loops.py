"""Where a reply loops: it ends in ``LOOP_REPEATS`` copies of one stretch of at most
``LOOP_PERIOD`` tokens, ``LOOP_LEAST`` tokens of them at least (``looping``).

What it is for: a sampled reply that loops is cut there (``session/generation.py``); a
constrained reply that loops is steered to close its shape (``constraint.Matcher``): cut, it
would be invalid JSON. A free greedy reply (``ask``, ``batch``) is left as the model writes it.
"""

from __future__ import annotations

# A sampled reply that ends in LOOP_REPEATS copies of one stretch of at most LOOP_PERIOD
# tokens, LOOP_LEAST tokens of them at least, is cut (finish "length", with a notice): the
# default model sampled at serve's defaults once wrote ", laQUEE" from its ~700th token to its
# 2,048-token cap (issue 35). Measured on its loops at its own 0.2 / top-p 0.9 (7 prompts x 10
# seeds, 256-token cap, loops left to run): the three exact loops were caught at 48-63 tokens
# (a flat 128-token span had taken 128-143), and none of the 64 replies that end on their own
# (counting, days of the week, "hello" five times among them) holds 48 tokens of 4 copies.
# Greedy replies (ask and batch, for scripts) are left as they are: reproducible, and bounded
# by their cap — but a constrained one is steered to close its shape instead of running to
# the cap unfinished (``constraint.Matcher``).
LOOP_LEAST = 48
LOOP_REPEATS = 4
LOOP_PERIOD = 32


def loop_span(period: int) -> int:
    """How many tokens of repeats of a ``period``-token stretch make a loop."""
    return max(LOOP_LEAST, LOOP_REPEATS * period)


def looping(ids: list[int], period: int = LOOP_PERIOD) -> int:
    """The period p of the loop ``ids`` ends in (its last ``loop_span(p)`` tokens repeat a
    stretch of p <= ``period`` tokens), or 0."""
    n = len(ids)
    for p in range(1, period + 1):
        span = loop_span(p)
        if n < span:
            return 0  # (the span only grows with p)
        if all(ids[k] == ids[k - p] for k in range(n - span + p, n)):  # (stops at a miss)
            return p
    return 0
