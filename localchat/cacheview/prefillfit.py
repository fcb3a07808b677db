"""The prefill cost model and its fit: what ``prefillmodel`` estimates with, apart from where
its samples come from.

What it is: ``PrefillModel`` (a fixed part, a per-token part, an attention term, and a
calibration's measured points), ``attended`` (the attention term's count for a model's layer
windows) and ``fit`` (least squares on relative error, coefficients never negative, a busy
machine's samples dropped). What it is not: a measurement (``prefillmodel`` measures and keeps
calibrations); it imports neither MLX nor the engine, so a benchmark can read a formula
without binding MLX's BLAS first.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_SAMPLES = 3  # three terms need three lengths
MIN_SPREAD = 2.0  # longest / shortest sample: closer lengths cannot part fixed from per-token
OUTLIER = 0.25  # a sample this much slower than the fit (relative) is a busy machine's
# The pieces a long prefill runs in (``engine.PREFILL_CHUNK``; a test keeps them equal).
CHUNK = 512


@dataclass(frozen=True)
class Sample:
    """One measured prefill: ``tokens`` fed after ``start`` cached ones took ``seconds``."""

    tokens: int
    start: int
    seconds: float


@dataclass(frozen=True)
class PrefillModel:
    """Seconds to prefill, fitted from ``samples`` measurements (``discarded`` more were
    outliers); ``source`` is "turns" or "calibration"."""

    fixed_s: float
    per_token_s: float
    attention_s: float  # per new token, per position it attends
    source: str
    samples: int
    discarded: int = 0
    overhead_s: float = 0.0  # of ``fixed_s``: a turn's own work beyond a calibrated prefill
    # A calibration's measured full prefills, (tokens, seconds) by length, never falling:
    # between them the cost is interpolated, beyond them the fitted terms carry it on.
    points: tuple[tuple[int, float], ...] = ()
    windows: tuple[tuple[int, float], ...] = ()  # the model's (``ModelInfo.attention``)

    def cost(self, tokens: int, start: int = 0) -> float:
        """Estimated seconds to feed ``tokens`` after ``start`` cached ones (0 for none)."""
        if tokens <= 0:
            return 0.0
        pairs = attended(tokens, start, self.windows)
        if not self.points:
            return self.fixed_s + self.per_token_s * tokens + self.attention_s * pairs
        return self.overhead_s + self._curve(tokens) + self.attention_s * (
            pairs - attended(tokens, 0, self.windows))

    def _line(self, tokens: int) -> float:
        """The fitted full prefill, without a turn's overhead."""
        return (self.fixed_s - self.overhead_s + self.per_token_s * tokens
                + self.attention_s * attended(tokens, 0, self.windows))

    def _curve(self, n: int) -> float:
        """A full prefill of ``n`` tokens off the measured points: interpolated between two,
        outside them the nearest one moved along the fitted line."""
        pts = self.points
        if n <= pts[0][0]:
            return max(0.0, pts[0][1] - (self._line(pts[0][0]) - self._line(n)))
        if n >= pts[-1][0]:
            return pts[-1][1] + self._line(n) - self._line(pts[-1][0])
        i = bisect.bisect_left(pts, (n, -math.inf))
        (n0, s0), (n1, s1) = pts[i - 1], pts[i]
        return s0 + (s1 - s0) * (n - n0) / (n1 - n0)

    def full(self, tokens: int) -> float:
        """Estimated seconds of a full prefill of ``tokens`` (no cache)."""
        return self.cost(tokens, 0)

    def describe(self) -> str:
        """Where the figures come from, in a few words, e.g. 'fitted from 4 turns'."""
        what = (f"fitted to {self.samples} turns of this conversation" if self.source == "turns"
                else f"from a calibration of this model on this machine ({self.samples} runs)")
        s = "s" if self.discarded > 1 else ""
        return (what + (f", {self.discarded} outlier{s} left out" if self.discarded else "")
                + (f", plus {self.overhead_s * 1e3:.0f} ms a turn takes beyond its prefill"
                   if self.overhead_s else ""))


def attended(tokens: int, start: int, windows: Sequence[tuple[int, float]] = ()) -> float:
    """The (query, key) pairs a prefill of ``tokens`` after ``start`` cached ones computes, on
    average over the attending layers (``windows``: ``ModelInfo.attention``): n·(k + n/2)
    where a layer keeps every position; a layer of window W (sliding or chunked) computes each
    ``CHUNK`` piece against at most W positions before it and the whole piece (its mask
    is a rectangle), so its part stops growing with the history. Counted as if every layer kept
    every position, the attention measured at depth 2,048 on a model of five 512-windows to one
    global layer (Gemma 3) came out 0.3-0.7 of this count's for full prefills of 1,024-4,096
    tokens and 1.5x for 256 tokens after 8,000 (the windows taken to grow past the depth)."""
    full = tokens * (start + tokens / 2)
    if not windows:
        return full
    total = 0.0
    for window, share in windows:
        if not window:
            total += share * full
            continue
        pairs, at, left = 0.0, start, tokens
        while left > 0:
            piece = min(CHUNK, left)
            pairs += piece * (min(at, window) + piece)
            at, left = at + piece, left - piece
        total += share * pairs
    return total


def fit(samples: Sequence[Sample], source: str,
        windows: Sequence[tuple[int, float]] = ()) -> PrefillModel | None:
    """The model that fits ``samples`` best, or None when they cannot determine one
    (``windows``: the model's, see ``attended``).

    Least squares on relative error (a 16-token sample counts as much as a 320-token one),
    with every coefficient ≥ 0 (the best of the fits over each subset of the three terms:
    a negative fixed part or rate is noise, not physics); samples slower than the fit by more
    than ``OUTLIER`` are dropped and the rest fitted again.
    """
    kept = [s for s in samples if s.tokens > 0 and s.start >= 0
            and math.isfinite(s.seconds) and s.seconds > 0]
    if len(kept) < MIN_SAMPLES or not spread_enough(kept):
        return None
    valid, dropped = kept, 0
    coef = None
    for _ in range(4):
        coef = _nonnegative_fit(kept, windows)
        if coef is None:
            return None
        slow = [s for s in kept if s.seconds > (1 + OUTLIER) * _predict(coef, s, windows)]
        rest = [s for s in kept if s not in slow]
        if not slow or len(rest) < MIN_SAMPLES or not spread_enough(rest):
            break
        # Drop the worst first: one busy moment can pull the fit up enough to make its
        # neighbours look slow too.
        worst = max(slow, key=lambda s: s.seconds / _predict(coef, s, windows))
        kept = [s for s in kept if s is not worst]
        dropped += 1
    return PrefillModel(*coef, source=source, samples=len(kept), discarded=dropped,
                        points=_points(valid) if source == "calibration" else (),
                        windows=tuple(windows))


def _points(samples: Sequence[Sample]) -> tuple[tuple[int, float], ...]:
    """The full prefills among ``samples``, the fastest of each length, as a curve that never
    falls (a point above a longer one's time is lowered to it: noise, not physics). Outliers
    of the line stay: the points are there for what the line cannot follow (the step after
    one pass, at 33 tokens ~30% above the line, was once dropped as a busy moment and a
    37-token turn's prefill read off 32 and 48 instead, ~0.03 s short)."""
    best: dict[int, float] = {}
    for s in samples:
        if s.start == 0:
            best[s.tokens] = min(best.get(s.tokens, math.inf), s.seconds)
    if len(best) < 2:
        return ()
    pts = sorted(best.items())
    low = math.inf
    for i in range(len(pts) - 1, -1, -1):
        low = min(low, pts[i][1])
        pts[i] = (pts[i][0], low)
    return tuple(pts)


def spread_enough(samples: Sequence[Sample]) -> bool:
    lengths = [s.tokens for s in samples]
    return max(lengths) >= MIN_SPREAD * min(lengths)


def _features(s: Sample, windows=()) -> tuple[float, float, float]:
    return (1.0, float(s.tokens), attended(s.tokens, s.start, windows))


def _predict(coef: tuple[float, float, float], s: Sample, windows=()) -> float:
    return sum(c * f for c, f in zip(coef, _features(s, windows)))


def _nonnegative_fit(samples: Sequence[Sample],
                     windows=()) -> tuple[float, float, float] | None:
    """Weighted least squares over every subset of the terms; the best fit with no negative
    coefficient (three terms: seven small solves, no optimiser needed)."""
    import numpy as np

    a = np.array([_features(s, windows) for s in samples], dtype=np.float64)
    t = np.array([s.seconds for s in samples], dtype=np.float64)
    w = 1.0 / t  # relative error
    best, best_err = None, math.inf
    for mask in range(1, 8):
        cols = [i for i in range(3) if mask >> i & 1]
        sub = a[:, cols] * w[:, None]
        try:
            x, _, rank, _ = np.linalg.lstsq(sub, t * w, rcond=None)
        except (np.linalg.LinAlgError, ValueError):  # non-finite input or no convergence
            continue
        if rank < len(cols) or not np.all(np.isfinite(x)) or np.any(x < 0):
            continue
        err = float(np.sum((sub @ x - t * w) ** 2))
        if err < best_err - 1e-15:  # (equal error: the fewer terms, found first, stay)
            coef = [0.0, 0.0, 0.0]
            for i, v in zip(cols, x):
                coef[i] = float(v)
            best, best_err = tuple(coef), err
    if best is None or best[1] == 0 and best[2] == 0:
        return None  # a cost that does not grow with the length: nothing to estimate from
    return best
