"""Structured output benchmark: what a grammar constraint costs per schema, per token, per row.

On the default model (or -m MODEL), side by side in one run (``localchat/model/constraint.py``):
- llguidance's tokenizer built from ours (once per loaded model; ``tokenizer_for`` keeps it);
- per constraint (JSON Schemas from 3 fields to a 16k-value enum, any object, a regex, a Lark
  grammar): ``parse_spec`` (every check, compiled against a byte tokenizer, before any model
  work) and ``Matcher`` (compiled against the model's vocabulary: what each turn pays);
- per token, in greedy constrained decodes of the model itself (a prompt per schema asking for
  that JSON): the mask (``allowed_mask``), ``forced``, the masked argmax and ``consume``,
  beside that step's forward pass; how many tokens the grammar forced; replayed without the
  model: the mask with warm caches, and a 4-token verify pass's ``masks``;
- per row: ``apply_masks`` on a [1, vocab] and a [5, vocab] MLX row (float32, bfloat16), the
  same function uncompiled, and an argmax of the row for scale.

Usage: python scripts/bench_constraint.py [--quick | --smoke] [-m MODEL] [--trials N]
       [--tokens N]
Full: 20 trials, decodes of up to 200 tokens; ``--quick``: 5 trials, 100 tokens; ``--smoke``:
1 trial, 12 tokens on a tiny model (``tests/test_scripts.py``; figures mean nothing).
Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

SIX = {"type": "object", "properties": {
    "name": {"type": "string"}, "city": {"enum": ["서울", "부산", "Paris", "Berlin"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    "verified": {"type": "boolean"}},
    "required": ["name", "city", "age", "email", "tags", "verified"],
    "additionalProperties": False}
LONG_NAMES = {"type": "object", "properties": {
    f"{w}_of_the_city_in_question": {"type": "string", "maxLength": 24}
    for w in ("official_name", "country", "population", "main_language", "mayor")},
    "additionalProperties": False}
LONG_NAMES["required"] = list(LONG_NAMES["properties"])
CONSTRAINTS = [  # label, kind, source, the prompt a decode asks with (None: not decoded)
    ("3 fields", "json_schema", {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"},
        "population": {"type": "integer"}}, "required": ["city", "country", "population"]},
     "Describe Paris as JSON with city, country and population."),
    ("6 fields, enum, format", "json_schema", SIX,
     "Make up a user profile as JSON: name, city, age, email, tags, verified."),
    ("5 long field names", "json_schema", LONG_NAMES,
     "서울에 대해 JSON으로 알려 주세요."),
    ("any object", "json_object", None, "Give me a JSON object about Berlin."),
    ("regex (date)", "regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "When did the Berlin wall fall?"),
    ("Lark (arithmetic)", "grammar", 'start: expr\nexpr: term (("+" | "-" | "*") term)*\n'
     'term: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n', "Write 12 times 7 as arithmetic."),
    ("16k-value enum", "json_schema", {"enum": [f"value {i:05d}" for i in range(16_000)]},
     None),
]


def timed(fn, trials: int) -> tuple[float, object]:
    """(median seconds, the last result) of ``fn()`` over ``trials`` runs after a warm-up."""
    out = fn()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def decode(engine, cm, spec, llt, prompt: str, max_tokens: int, steps: dict) -> dict:
    """A greedy constrained decode of the model, each step's costs appended to ``steps``."""
    import mlx.core as mx

    matcher = cm.Matcher(spec, llt)
    cache = engine.new_cache()
    logits = benchlib.prefill(engine, engine.render([{"role": "user", "content": prompt}]),
                              cache)
    out: list[int] = []
    while len(out) < max_tokens and not matcher.stopped:
        t0 = time.perf_counter()
        mask = matcher.allowed_mask()
        t1 = time.perf_counter()
        matcher.forced()
        t2 = time.perf_counter()
        tok = int(mx.argmax(cm.apply_masks(logits, mask), axis=-1).item())
        t3 = time.perf_counter()
        matcher.consume(tok)
        t4 = time.perf_counter()
        out.append(tok)
        if tok in matcher.ends or matcher.stopped:
            break
        logits = engine.model(mx.array([[tok]]), cache=cache)[:, -1, :]
        mx.eval(logits)
        t5 = time.perf_counter()
        for key, dt in (("mask", t1 - t0), ("forced", t2 - t1), ("apply+argmax", t3 - t2),
                        ("consume", t4 - t3), ("forward", t5 - t4)):
            steps[key].append(dt)
    replay(cm, spec, llt, out, steps)
    return {"tokens": len(out), "complete": matcher.stopped,
            "forced_tokens": matcher.describe().forced_tokens,
            "text": engine.decode_text([t for t in out if t not in matcher.ends])}


def replay(cm, spec, llt, out: list[int], steps: dict) -> None:
    """The decode again without the model: each position's mask with no forward pass between
    (measured: a forward pass evicts llguidance's token trie from the CPU caches, ~3 µs warm
    against ~70 µs after touching 64 MB; the in-loop figure is the one a turn pays), and the
    masks of a verify pass over the next 4 tokens (what lookup speculation asks for)."""
    m = cm.Matcher(spec, llt)
    for i, tok in enumerate(out):
        draft = out[i:i + 4]
        t0 = time.perf_counter()
        m.allowed_mask()
        t1 = time.perf_counter()
        m.masks(draft[:m.validate(draft)])
        t2 = time.perf_counter()
        m.consume(tok)
        steps["mask, no forward between"].append(t1 - t0)
        steps["verify masks (4)"].append(t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "5 trials, 100-token decodes")
    ap.add_argument("--trials", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    args = ap.parse_args()
    trials = args.trials or benchlib.pick(args, 20, 5, 1)
    max_tokens = args.tokens or benchlib.pick(args, 200, 100, 12)

    benchlib.scratch_home()
    import localchat.cpu.backend as backend

    backend.prepare()
    import mlx.core as mx
    import numpy as np

    import localchat.model.constraint as cm
    from localchat.model.engine import Engine

    engine = Engine.load(args.model)
    ends = engine.end_tokens().ends
    build_s, llt = timed(lambda: cm.build_tokenizer(engine.tokenizer, ends), min(trials, 3))
    vocab = llt.vocab_size

    rows, steps = [], {k: [] for k in ("mask", "forced", "apply+argmax", "consume", "forward",
                                       "mask, no forward between", "verify masks (4)")}
    for label, kind, source, prompt in CONSTRAINTS:
        parse_s, spec = timed(lambda k=kind, s=source: cm.parse_spec(k, s), trials)
        compile_s, _ = timed(lambda s=spec: cm.Matcher(s, llt), trials)
        row = {"name": label, "kind": kind, "source_bytes": len(spec.source.encode()),
               "parse_ms": 1e3 * parse_s, "compile_ms": 1e3 * compile_s}
        if prompt is not None:
            row.update(decode(engine, cm, spec, llt, prompt, max_tokens, steps))
            if kind in ("json_object", "json_schema") and row["complete"]:
                try:
                    json.loads(row["text"])
                    row["parses"] = True
                except ValueError:
                    row["parses"] = False
        rows.append(row)

    def us(xs: list[float], q: float = 0.5) -> float:
        return 1e6 * float(np.quantile(xs, q)) if xs else float("nan")

    per_token = {k: {"median": us(v), "p90": us(v, 0.9), "max": us(v, 1.0)}
                 for k, v in steps.items()}

    # Per row, on the model's own vocabulary width.
    width = int(engine.model(mx.array([[0]]), cache=engine.new_cache()).shape[-1])
    mask = cm.Matcher(cm.parse_spec("json_schema", SIX), llt).allowed_mask()
    apply_us = {}
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(mx, dtype_name)
        for n in (1, 5):
            logits = mx.random.normal((n, width)).astype(dtype)
            masks = np.stack([mask] * n)
            mx.eval(logits)
            t, _ = timed(lambda lg=logits, m=masks: mx.eval(cm.apply_masks(lg, m)), trials * 10)
            apply_us[f"{n} row{'s' if n > 1 else ''} {dtype_name}"] = 1e6 * t
    logits = mx.random.normal((1, width))
    mx.eval(logits)
    t, _ = timed(lambda: mx.eval(_uncompiled(mx, np, logits, mask)), trials * 10)
    apply_us["1 row float32, uncompiled"] = 1e6 * t
    t, _ = timed(lambda: mx.argmax(logits, axis=-1).item(), trials * 10)
    apply_us["argmax of 1 row (scale)"] = 1e6 * t

    forward_ms = 1e3 * statistics.median(steps["forward"]) if steps["forward"] else float("nan")
    overhead = sum(per_token[k]["median"] for k in ("mask", "forced", "consume")) + \
        apply_us["1 row float32"]
    print(f"# structured output · {engine.ref.name} · vocabulary {vocab} (logits {width}) · "
          f"{benchlib.machine()} · median of {trials}")
    print(f"llguidance tokenizer built in {build_s:.3f} s (once per loaded model)\n")
    benchlib.print_table(
        ["constraint", "bytes", "parse ms", "compile ms", "tokens", "forced", "complete",
         "text"],
        [[r["name"], r["source_bytes"], r["parse_ms"], r["compile_ms"], r.get("tokens", "-"),
          r.get("forced_tokens", "-"), r.get("complete", "-"),
          (r.get("text", "-")[:40]).replace("\n", " ")] for r in rows])
    print()
    benchlib.print_table(["per token (µs)", "median", "p90", "max"],
                         [[k, v["median"], v["p90"], v["max"]] for k, v in per_token.items()])
    print()
    benchlib.print_table(["apply_masks", "µs"], [[k, v] for k, v in apply_us.items()])
    print(f"\nmask + forced + consume + apply on one row: {overhead:.0f} µs a token, "
          f"{benchlib.ratio(overhead / 1e3, forward_ms):.1%} of a {forward_ms:.2f} ms "
          "forward step")
    benchlib.print_json({"bench": "constraint", "mode": benchlib.mode(args),
                         "model": engine.ref.name, "machine": benchlib.machine(),
                         "vocab": vocab, "logits_width": width, "trials": trials,
                         "tokenizer_build_s": build_s, "schemas": rows,
                         "per_token_us": per_token, "apply_us": apply_us,
                         "forward_ms": forward_ms, "overhead_us": overhead,
                         "overhead_vs_forward": benchlib.ratio(overhead / 1e3, forward_ms)})


def _uncompiled(mx, np, logits, mask):
    """``apply_masks``' function as written, not compiled: what compiling saves."""
    bits = mx.arange(32, dtype=mx.int32)
    words = mx.array(np.atleast_2d(mask))
    allowed = ((words[:, :, None] >> bits) & 1).reshape(words.shape[0], -1) != 0
    return mx.where(allowed[:, :logits.shape[1]], logits, mx.array(-mx.inf, logits.dtype))


if __name__ == "__main__":
    main()
