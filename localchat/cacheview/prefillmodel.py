"""How long a full prefill takes on this machine, as a function of its length.

What it is: the samples of a three-term cost model (``prefillfit.py``: the model and its
least-squares fit) that the cache view (``tui/cachescreen.py``) and ``inspect -c``
(``report.py``) use to estimate what a turn would have cost without its cache: the
conversation's turns, or a calibration measured and kept. Feeding ``n`` tokens after ``k``
cached ones costs

    fixed + per_token·n + attention·n·(k + n/2)

(the attention term: each new token attends every position before it; a model with sliding
windows or chunks counts what its layers look back over instead, ``prefillfit.attended``). A
full prefill is ``k = 0``. The old estimate (cached tokens ÷ the median rate of short turns)
counted a turn's fixed overhead as per-token cost and claimed savings ten times too large; here
the overhead lands in ``fixed`` and the per-token part comes from how the time grows with the
length.

Where the samples come from, in order:
1. the conversation's own turns that prefilled at least ``MIN_TOKENS`` (their time to first
   token), when there are ``MIN_SAMPLES`` of them spanning lengths a fit can tell apart;
2. else a calibration: full prefills of a few hundred tokens and one run of tokens fed after
   a deep cache (the attention term, which short prefills cannot show), measured once per
   model and machine and kept in ``paths.prefill_models_dir()`` (checksummed and
   schema-checked when read back; a damaged or foreign file is measured again, never
   trusted), plus the median of what the conversation's turns took beyond their calibrated
   prefill (a turn's own work: its lock, rendering, reading the cache), so it estimates a
   turn's TTFT. A calibration the turns outrun was made on a busy machine: it is measured
   again and the faster run of each length kept, so it converges on the machine's speed.
   Within the calibrated lengths a full prefill is read off the measured points
   (interpolated): the cost per token falls with the length at these sizes, which a line
   cannot follow (it put a 60-token prefill ~20% low); the fitted terms carry it beyond
   them, the attention term (measured at depth) for tokens fed after cached ones too.

Samples from a busy machine are discarded as outliers (slower than the fit by more than
``OUTLIER``): a machine is never faster than it can be, only slower. Every figure made from
this model is an estimate and the front ends say so.

What it is not: a benchmark (``scripts/bench_figures.py`` checks the estimates against
measured full prefills).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from .. import paths
from ..files import atomic_write, xxh3
from ..kvcache import synthetic
from ..kvcache.synthetic import drain as _drain
from .prefillfit import OUTLIER, PrefillModel, Sample, fit

MIN_TOKENS = 64  # a turn that prefilled fewer is mostly fixed overhead: it says little
# A few hundred tokens (seconds on a small model), densest where turns are: the cost per token
# is not constant at these lengths (on the default model here ~4.6 ms/token between 16 and 64
# tokens, ~3 between 64 and 160), so a calibration's full prefill is read off its measured
# points, not off the fitted line (``PrefillModel.points``). A prompt of up to
# ``engine.ONE_PASS`` (32) tokens runs the model once; one token longer, its body and then its
# last token apart: a step of ~0.05 s that 32 and 33 both measured keep where it is
# (interpolated from 32 to 48, a 37-token turn was estimated 0.035 s short, so the turn's own
# overhead taken from it came out that much too large, every full prefill ~10% high).
CALIBRATION = (16, 32, 33, 48, 64, 96, 128, 256, 320)
REPEATS = 2  # each length is measured this many times; the fastest counts
# The attention term, measured where it matters: ``DEPTH_TOKENS`` fed after ``DEPTH`` cached
# positions (a cache of random K/V made at once, no prefill of them). Fitted from the short
# full prefills alone it came out 0 (at 320 tokens attention is a few % of the time, within
# the noise) and a long prompt was estimated short: 0.74-0.88 of the measured full prefill at
# 1,280 tokens, 0.55 at 4,096 on the default model. Per new token and cached position it
# costs ~1.3 us there when 256 tokens are fed at once, ~1.2 in the 512-token chunks of a long
# prefill, ~1.6 for 128 (smaller products are less efficient): 256 is close and costs ~1.4 s.
DEPTH = 2048
DEPTH_TOKENS = 256
SCHEMA = 4  # 4: the attention term measured at depth (3: the one-pass step; 2: 8 lengths)


class Stopped(Exception):
    """A calibration stopped before its end (``measure_prefills``'s ``stopped``)."""


def from_turns(turns: Sequence, windows=()) -> PrefillModel | None:
    """Fitted from recorded turns (``store.TurnRecord``) that prefilled at least
    ``MIN_TOKENS``: their time to first token against what they fed after what was cached."""
    samples = [Sample(t.prefilled_tokens, t.cached_tokens, t.ttft_s) for t in turns
               if t.prefilled_tokens >= MIN_TOKENS]
    return fit(samples, "turns", windows)


def windows_of(engine) -> tuple[tuple[int, float], ...]:
    return getattr(engine.info(), "attention", ())


def for_conversation(engine, turns: Sequence, *, calibrate_now: bool = True,
                     clock: Callable[[], float] = time.perf_counter,
                     progress: Callable[[str], None] | None = None,
                     stopped: Callable[[], bool] = lambda: False) -> PrefillModel | None:
    """The model for a conversation's figures: its own turns when they can say, else this
    model's calibration on this machine (measured now if there is none and
    ``calibrate_now``; it takes seconds, on the thread that runs the model, and
    ``progress`` is told first; ``stopped()`` is asked before each run of it and stops it
    with ``Stopped``)."""
    fitted = from_turns(turns, windows_of(engine))
    if fitted is not None:
        return fitted
    # The deep run only for a conversation whose prompts reach past the calibrated lengths:
    # within them a full prefill is read off the measured points, and its turns' attention
    # after a short cache is a few ms.
    deep = any(t.prompt_tokens > CALIBRATION[-1] for t in turns)
    calibrated = calibration(engine, measure=calibrate_now, deep=deep, clock=clock,
                             progress=progress, stopped=stopped)
    if calibrated is not None and calibrate_now and slower_than_turns(calibrated, turns):
        calibrated = calibration(engine, again=True, deep=deep, clock=clock,
                                 progress=progress, stopped=stopped) or calibrated
    return with_turn_overhead(calibrated, turns) if calibrated is not None else None


def slower_than_turns(model: PrefillModel, turns: Sequence) -> bool:
    """Whether the conversation's turns ran faster than the calibration says their prefill
    alone takes (by more than ``OUTLIER``, on the median): it was measured on a busy machine."""
    ratios = [t.ttft_s / model.cost(t.prefilled_tokens, t.cached_tokens) for t in turns
              if t.prefilled_tokens > 0 and math.isfinite(t.ttft_s) and t.ttft_s > 0]
    return bool(ratios) and statistics.median(ratios) < 1 - OUTLIER


def with_turn_overhead(model: PrefillModel, turns: Sequence) -> PrefillModel:
    """A calibration times the prefill alone; a turn's time to first token also holds the
    turn's own work (the lock, reading the conversation, rendering, reading its cache). The
    median of what the turns took beyond the calibrated prefill (never below 0) is added
    to the fixed part, so a full prefill is estimated as a turn would see it. Where some
    turns had no cache (a conversation's first, a miss), only theirs count: a cached turn's
    own work also reads its cache back from disk, which a full prefill does not (on the
    default model here that put the estimates ~10% high, the time saved ~20%)."""
    usable = [t for t in turns
              if t.prefilled_tokens > 0 and math.isfinite(t.ttft_s) and t.ttft_s > 0]
    uncached = [t for t in usable if t.cached_tokens == 0]
    extra = [t.ttft_s - model.cost(t.prefilled_tokens, t.cached_tokens)
             for t in uncached or usable]
    over = max(0.0, statistics.median(extra)) if extra else 0.0
    return replace(model, fixed_s=model.fixed_s + over, overhead_s=over)


# -- the calibration ---------------------------------------------------------------------------

def machine_key(engine) -> str:
    """Model and machine: the cache fingerprint (weights, K/V dtype), the CPU and the MLX
    device and path; a calibration made under any other is not this one's."""
    import mlx.core as mx

    from ..cpu import backend
    from ..cpu.probe import cpu_identity

    who = {"model": engine.cache_fingerprint, "cpu": cpu_identity(),
           "machine": platform.machine(), "device": str(mx.default_device()),
           "cpu_path": bool(backend.cpu_path())}
    return hashlib.sha256(json.dumps(who, sort_keys=True).encode()).hexdigest()[:32]


def calibration_path(key: str):
    return paths.prefill_models_dir() / f"{key}.json"


def calibration(engine, *, measure: bool = True, again: bool = False, deep: bool = True,
                clock: Callable[[], float] = time.perf_counter,
                progress: Callable[[str], None] | None = None,
                stopped: Callable[[], bool] = lambda: False) -> PrefillModel | None:
    """This model's calibration on this machine: read back, or measured and kept.

    ``again``: measure even if one is kept, and keep the faster run of each length, old or
    new: a calibration made while the machine was busy heals (a machine is never faster than
    it can be, so the fastest run seen is the closest to its speed). ``deep``: with the
    deep run (the attention term: ~4.6 s of ~13 on the default model here); without it,
    what a conversation of prompts within the calibrated lengths needs. A kept calibration
    without it, asked for it, has only the deep run measured and added.
    """
    key = machine_key(engine)
    path = calibration_path(key)
    kept = read_samples(path, key)
    has_deep = kept is not None and any(s.start > 0 for s in kept)
    # (measured again, a kept deep run is too: the new full runs with a deep run from a busier
    # moment would put the attention term high)
    wanted = (deep or has_deep) and depth_for(engine) > 0
    lacking = kept is not None and wanted and not has_deep
    if kept is not None and not again and not (lacking and measure):
        return fit(kept, "calibration", windows_of(engine))
    if not measure:
        return None
    if progress is not None:
        progress("measuring this model's prefill speed on this machine "
                 + ("at depth (seconds, once)" if lacking and not again
                    else "(seconds, once per model and machine)"))
    lengths = () if lacking and not again else CALIBRATION
    fastest: dict[tuple[int, int], Sample] = {}
    for s in (kept or []) + measure_prefills(engine, lengths, clock=clock, depth=wanted,
                                             stopped=stopped):
        if (s.tokens, s.start) not in fastest or s.seconds < fastest[s.tokens, s.start].seconds:
            fastest[s.tokens, s.start] = s
    samples = sorted(fastest.values(), key=lambda s: (s.tokens, s.start))
    model = fit(samples, "calibration", windows_of(engine))
    if model is not None:
        write_calibration(path, key, samples)
    return model


def measure_prefills(engine, lengths: Sequence[int] = CALIBRATION, repeats: int = REPEATS,
                     clock: Callable[[], float] = time.perf_counter,
                     depth: bool = True,
                     stopped: Callable[[], bool] = lambda: False) -> list[Sample]:
    """Full prefills of each length into a fresh cache, up to the first token (as a
    ``--no-cache`` turn does), the fastest of ``repeats`` runs of each; and (``depth``)
    ``DEPTH_TOKENS`` fed after a deep cache (``depth_for``), each run right after a full
    prefill of as many tokens: what it took more than that one, the least of the rounds, is
    the attention term's time, added to the fastest full run of that length: a busy moment
    that spans a pair cancels out, one that hits a deep run alone is outdone by another
    round. (Kept apart, the deep run's fastest and the full runs' fastest could come from
    different moments of a machine whose speed moves by 2x within the hour.)

    Raises:
        Stopped: ``stopped()`` said so before a run (each takes up to ~1.5 s on the default
            model here; the whole 8.5-13 s): the app is closing, and nothing is kept.
    """

    def run(tokens: list[int], cache: list | None = None) -> float:
        if stopped():
            raise Stopped("the calibration was stopped")
        return run_prefill(engine, tokens, clock, cache)

    text = " ".join(f"{w} {i}." for i, w in enumerate(
        "the quick brown fox jumps over a lazy dog near the river bank".split() * 40))
    ids = engine.encode(text)
    while len(ids) < max(*lengths, DEPTH_TOKENS, 1):
        ids = ids + ids
    # Warm-up: the first call of each path (one pass, chunked) compiles and allocates.
    run(ids[:8])
    run(ids[:40])
    depth = depth_for(engine) if depth else 0
    best = {n: math.inf for n in (*lengths, DEPTH_TOKENS)}
    extra = math.inf
    for _ in range(repeats):  # rounds over the lengths: a busy moment spoils one run, not both
        for n in lengths:
            if not (depth and n == DEPTH_TOKENS):  # (measured next to the deep run)
                best[n] = min(best[n], run(ids[:n]))
        if depth:
            cache = deep_cache(engine, depth)
            base = run(ids[:DEPTH_TOKENS])
            extra = min(extra, run(ids[:DEPTH_TOKENS], cache) - base)
            best[DEPTH_TOKENS] = min(best[DEPTH_TOKENS], base)
    return [Sample(n, 0, best[n]) for n in lengths] + (
        [Sample(DEPTH_TOKENS, depth, best[DEPTH_TOKENS] + max(extra, 0.0))] if depth else [])


def depth_for(engine) -> int:
    """How many cached positions the attention term is measured after: ``DEPTH``, less on a
    model whose context cannot hold it and ``DEPTH_TOKENS`` more; 0 (not measured: the short
    prefills' fit stands) when that leaves under half of it, or when no layer's cache grows
    (recurrent layers only: nothing attends more positions as a conversation grows) or one
    is of a class localchat does not know."""
    info = engine.info()
    depth = min(DEPTH, info.context_length - DEPTH_TOKENS - 1)
    grows = info.kv_bytes_per_token > 0 and not info.unknown
    return depth if grows and depth >= DEPTH // 2 else 0


def deep_cache(engine, depth: int) -> list:
    """A new cache at ``depth`` positions with room for ``DEPTH_TOKENS`` more
    (``kvcache.synthetic``)."""
    return synthetic.deep_cache(engine, depth, DEPTH_TOKENS)


def run_prefill(engine, tokens: list[int], clock: Callable[[], float],
                cache: list | None = None) -> float:
    """Seconds to prefill ``tokens`` into ``cache`` (a new one by default) and pick the
    first token."""
    import mlx.core as mx

    t = clock()
    cache = engine.new_cache() if cache is None else cache
    logits = _drain(engine.prefill(tokens, cache))
    mx.eval(mx.argmax(logits, axis=-1))
    return clock() - t


def _body(key: str, samples: Sequence[Sample]) -> dict:
    return {"schema": SCHEMA, "key": key, "made": round(time.time()),
            "samples": [[s.tokens, s.start, s.seconds] for s in samples]}


def _digest(body: dict) -> int:
    return xxh3(json.dumps(body, sort_keys=True).encode())


def write_calibration(path, key: str, samples: Sequence[Sample]) -> None:
    """Keep the samples (the fit is made again on reading: one code path), checksummed; a
    data folder that cannot be written only means measuring again next time."""
    body = _body(key, samples)
    try:
        paths.ensure(path.parent)
        atomic_write(path, json.dumps({**body, "xxh3": _digest(body)}).encode())
    except OSError:
        pass  # (read-only or full: the figures still come, measured again next time)


def read_calibration(path, key: str) -> PrefillModel | None:
    """The kept calibration, or None when missing, damaged, of another model or machine,
    or not a calibration a fit can use (the caller then measures again)."""
    samples = read_samples(path, key)
    return fit(samples, "calibration") if samples is not None else None


def read_samples(path, key: str) -> list[Sample] | None:
    """The kept calibration's samples, or None (see ``read_calibration``)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or set(data) != {"schema", "key", "made", "samples", "xxh3"}:
        return None
    body = {k: v for k, v in data.items() if k != "xxh3"}
    if data["xxh3"] != _digest(body) or data["schema"] != SCHEMA or data["key"] != key:
        return None
    rows = data["samples"]
    if not isinstance(rows, list) or not all(
            isinstance(r, list) and len(r) == 3 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in r)
            for r in rows):
        return None
    samples = [Sample(int(n), int(k), float(s)) for n, k, s in rows]
    return samples if fit(samples, "calibration") is not None else None

