"""The quality gate of quantized KV caches: measured per model, before a setting is used.

What it is: ``measure`` runs a fixed English and Korean conversation through the model twice —
with the history's K/V as computed, and with them quantized the way localchat stores them
(``kvcache.kinds.quantize_growing``: history quantized, the current turn at full precision) — and
compares the next-token predictions over a fixed reply, teacher-forced: top-1 agreement and
the mean absolute change of the reference tokens' log-probability. ``check`` applies the gate
(``GATE``) and remembers the measurement per model and setting in ``kv-quality.json``, so it
(~1-3 s on the default model's CPU path) runs once. A setting that fails is refused with a
one-line reason instead of producing nonsense.

A remembered measurement is used only if it is exactly what ``measure`` writes: the three
figures of their types and ranges, the reply's length, and a checksum of the entry with its
key (``_entry_check``). Anything else — a damaged, truncated or hand-edited file — is measured
again and rewritten, so no file can make a failing setting pass.

What it is not: a benchmark of speed or disk (``scripts/bench_kvquant.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import BadInput
from ..files import read_memo, write_memo
from ..paths import data_home
from . import kinds as ck
from .format import checksum

VERSION = 1  # bump when the script or the metric changes: older verdicts are measured again
# Top-1 agreement with the unquantized cache over the reply, and the mean |Δ log p| of the
# reply's tokens. 8-bit passes on every model we tried; 4-bit is refused where it bends the
# model's choices (the default 135M model), accepted where it does not.
GATE = {"agreement": 0.95, "nll": 0.05}

SCRIPT = [
    {"role": "system", "content": "You are a helpful travel assistant."},
    {"role": "user", "content": "I am planning three days in Seoul next spring. The museum "
                                "opens at nine and the guided tour starts at ten."},
    {"role": "assistant", "content": "Great choice! Spring in Seoul is lovely. Start with "
                                     "Gyeongbokgung Palace in the morning, then walk to "
                                     "Bukchon Hanok Village."},
    {"role": "user", "content": "서울의 날씨는 봄에 어떤가요? "
                                "다음 주에는 부산에 가서 바다를 볼 계획입니다."},
    {"role": "assistant", "content": "봄의 서울은 맑고 따뜻합니다. 부산에서는 해운대 해변을 "
                                     "걸어 보세요."},
    {"role": "user", "content": "Which train should I book from Seoul to Busan, and how long "
                                "does it take?"},
]
REPLY = ("Take the KTX high-speed train from Seoul Station to Busan Station. It takes about "
         "two and a half hours, and trains leave every thirty minutes. 기차표는 미리 예약하세요.")


@dataclass(frozen=True)
class Quality:
    agreement: float  # share of reply positions whose top token is unchanged
    nll_delta: float  # mean |Δ log p| of the reply's tokens
    positions: int

    def passes(self) -> bool:
        return self.agreement >= GATE["agreement"] and self.nll_delta <= GATE["nll"]


def measure(engine, quant: ck.KVQuant) -> Quality:
    """Teacher-forced comparison over ``REPLY`` after ``SCRIPT`` (see the module docstring)."""
    import mlx.core as mx

    history = engine.render(SCRIPT)
    reply = engine.encode(REPLY)
    specs = list(engine.layout(quant).growing)
    results = []
    for quantized in (False, True):
        cache = engine.new_cache()
        for _ in engine.prefill(history, cache):
            pass
        if quantized:
            ck.quantize_growing(cache, specs, 0, len(history), quant)
        logits = engine.model(mx.array(reply)[None], cache=cache)[0].astype(mx.float32)
        results.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    ref, got = results
    targets = mx.array(reply[1:])
    rows = mx.arange(len(reply) - 1)
    agree = mx.mean((mx.argmax(ref, -1) == mx.argmax(got, -1)).astype(mx.float32)).item()
    delta = mx.mean(mx.abs(ref[rows, targets] - got[rows, targets])).item()
    return Quality(round(agree, 4), round(delta, 4), len(reply))


def setting(engine, bits: int, group: int | None) -> ck.KVQuant | None:
    """The KV storage ``--kv-bits bits --kv-group-size group`` asks for (None: float16),
    checked against the model (a group dividing the head dimension) and the gate.

    Raises:
        BadInput: one line, what to use instead.
    """
    if bits == 0:
        return None
    if bits not in (4, 8):
        raise BadInput("--kv-bits must be 8 or 4 (or 0 for float16)")
    name = engine.ref.name
    growing = engine.layout().growing
    if not growing:
        raise BadInput(f"{name} keeps no growing K/V to quantize")
    width = growing[0].k_shape[1]
    group = group or ck.default_group(width)
    if group not in (32, 64, 128) or not any(ck.KVQuant(bits, group).fits(s)
                                             for s in growing):
        raise BadInput(f"--kv-group-size must be 32, 64 or 128 and divide the head "
                       f"dimension ({width} for {name})")
    quant = ck.KVQuant(bits, group)
    check(engine, quant)
    return quant


def check(engine, quant: ck.KVQuant) -> Quality:
    """The gate's verdict for ``quant`` on ``engine``'s model (measured once, remembered).

    Raises:
        BadInput: the setting fails the gate (one line: the figures and what to use).
    """
    key = f"{engine.info().model_digest[:32]}|{quant.bits}|{quant.group}|v{VERSION}"
    path = data_home() / "kv-quality.json"
    memo = read_memo(path)
    quality = _remembered(memo.get(key), key, len(engine.encode(REPLY)))
    if quality is None:
        quality = measure(engine, quant)
        memo[key] = {**quality.__dict__, "check": _entry_check(key, quality)}
        write_memo(path, memo)
    if not quality.passes():
        raise BadInput(
            f"--kv-bits {quant.bits} (group {quant.group}) fails the quality gate on "
            f"{engine.ref.name}: top-1 agreement {quality.agreement:.0%}, mean |Δ log p| "
            f"{quality.nll_delta:.3f} (needs ≥ {GATE['agreement']:.0%} and ≤ {GATE['nll']}); "
            "use --kv-bits 8, or a smaller --kv-group-size")
    return quality


def _entry_check(key: str, q: Quality) -> str:
    return checksum({"key": key, **q.__dict__})


def _remembered(entry, key: str, positions: int) -> Quality | None:
    """The measurement ``entry`` holds if it is exactly what ``check`` wrote for ``key``
    (a reply of ``positions`` tokens); None on any doubt."""
    if type(entry) is not dict or entry.keys() != {"agreement", "nll_delta", "positions",
                                                   "check"}:
        return None
    a, nll, n = entry["agreement"], entry["nll_delta"], entry["positions"]
    if type(a) is not float or type(nll) is not float or type(n) is not int or \
            not (0.0 <= a <= 1.0 and 0.0 <= nll < math.inf and n == positions):
        return None
    quality = Quality(a, nll, n)
    return quality if entry["check"] == _entry_check(key, quality) else None
