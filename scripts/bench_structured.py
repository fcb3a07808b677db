"""Structured output end to end: how often replies parse, and what the grammar costs a decode.

Two parts, on the default model (or -m MODEL) in a scratch data folder, one model load, each
reply a lone greedy turn through ``Session.complete`` as a batch line runs it:

1. **Validity**: 5 JSON Schemas (flat, enums, nested, arrays with bounds, a pattern) × the
   prompts (a quarter in Korean), each asked for JSON in words only (the prompt names the
   fields) and then constrained by the schema (``constraint=``): how many parse, and how many
   validate (``jsonschema``, as the tests do).
2. **Speed**, side by side in one run, trials alternating: free decode against decode
   constrained by a schema of one long string field (the mask's cost per token), and
   constrained plain decode (``speculate="off"``) against constrained decode with the
   grammar's forced tokens as free drafts and prompt lookup (a schema of ten long field
   names: most of the reply is forced). Tokens per second of the reply (``Usage.decode_tps``),
   median over trials.

Usage: python scripts/bench_structured.py [--quick | --smoke] [-m MODEL]
Full: 20 prompts per schema, 5 speed trials; ``--quick``: 4 prompts, 3 trials; ``--smoke``:
1 prompt, 1 trial, short caps, for a tiny model (``tests/test_scripts.py``; figures mean
nothing). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


SCHEMAS = {
    "person": _obj({"name": {"type": "string", "maxLength": 40},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130},
                    "city": {"type": "string", "maxLength": 40}}),
    "review": _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
                    "score": {"type": "integer", "minimum": 1, "maximum": 5},
                    "summary": {"type": "string", "maxLength": 80}}),
    "event": _obj({"title": {"type": "string", "maxLength": 60},
                   "when": _obj({"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                 "month": {"type": "integer", "minimum": 1, "maximum": 12}}),
                   "place": {"type": "string", "maxLength": 40}}),
    "shopping": _obj({"items": {"type": "array", "minItems": 1, "maxItems": 5,
                                "items": {"type": "string", "maxLength": 30}},
                      "store": {"type": "string", "maxLength": 30}}),
    "contact": _obj({"name": {"type": "string", "maxLength": 40},
                     "phone": {"type": "string", "pattern": "^[0-9]{2,3}-[0-9]{3,4}-[0-9]{4}$"}}),
}
SUBJECTS = [  # (English, Korean): what each prompt is about
    ("my friend Anna, 34, who lives in Lyon", "부산에 사는 서른 살 친구 민수"),
    ("a movie I loved, five stars", "지루했던 영화, 별 두 개"),
    ("a concert on 12 March at the town hall", "5월 3일 서울 시청 앞 축제"),
    ("bread, milk and eggs from the corner shop", "마트에서 살 사과, 우유, 라면"),
    ("Tom Lee, phone 010-1234-5678", "김지영, 전화 02-555-1234"),
]
LONG_FIELD = _obj({"description_of_the_thing": {"type": "string", "maxLength": 400}})
TEN_NAMES = _obj({f"the_{w}_property_of_this_record": {"type": "boolean"}
                  for w in ("first", "second", "third", "fourth", "fifth", "sixth",
                            "seventh", "eighth", "ninth", "tenth")})


def prompts(schema_name: str, n: int) -> list[str]:
    """``n`` prompts for a schema, every fourth in Korean."""
    fields = ", ".join(SCHEMAS[schema_name]["properties"])
    out = []
    for i in range(n):
        en, ko = SUBJECTS[(list(SCHEMAS).index(schema_name) + i) % len(SUBJECTS)]
        if i % 4 == 3:
            out.append(f"다음 내용을 JSON 객체로만 답하세요 (필드: {fields}): {ko}")
        else:
            variant = ("", " Be brief.", " Answer with the JSON only.")[i % 3]
            out.append(f"Reply with a JSON object with the fields {fields} about {en}."
                       f"{variant}")
    return out


def validates(schema: dict, text: str) -> tuple[bool, bool]:
    """(parses, validates) for a reply: the JSON may sit in a Markdown fence."""
    import jsonschema

    body = text.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[-1].rsplit("```", 1)[0]
    try:
        value = json.loads(body)
    except ValueError:
        return False, False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def one(session, prompt: str, cap: int, constraint=None, speculate: str = "lookup"):
    from localchat.events import TurnFinished
    from localchat.kvcache.prefixes import PrefixPool
    from localchat.session.session import TurnOptions

    pool = PrefixPool(session.engine.new_cache)  # (no prefix shared between trials)
    options = TurnOptions(max_tokens=cap, constraint=constraint, speculate=speculate)
    for ev in session.complete([{"role": "user", "content": prompt}], pool, options):
        if isinstance(ev, TurnFinished):
            return ev
    raise SystemExit("no reply")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "4 prompts per schema, 3 speed trials")
    args = ap.parse_args()
    n = benchlib.pick(args, 20, 4, 1)
    trials = benchlib.pick(args, 5, 3, 1)
    cap = benchlib.pick(args, 160, 160, 24)
    benchlib.scratch_home()
    from localchat.model.constraint import parse_spec
    from localchat.session.session import open_session

    session = open_session(args.model)
    t0 = time.perf_counter()
    rows, validity = [], {}
    try:
        one(session, "Hello", 4)  # warm-up: the first call compiles and allocates
        for name, schema in SCHEMAS.items():
            spec = parse_spec("json_schema", schema)
            got = {"free": [0, 0], "constrained": [0, 0]}
            for prompt in prompts(name, n):
                for how, c in (("free", None), ("constrained", spec)):
                    parsed, ok = validates(schema, one(session, prompt, cap, c).reply)
                    got[how][0] += parsed
                    got[how][1] += ok
            validity[name] = {"prompts": n, **{how: {"parse": p, "valid": v}
                                               for how, (p, v) in got.items()}}
            rows.append([name, n, got["free"][0], got["free"][1], got["constrained"][0],
                         got["constrained"][1]])
        long_spec, ten_spec = parse_spec("json_schema", LONG_FIELD), parse_spec(
            "json_schema", TEN_NAMES)
        ask_long = "Describe the city of Seoul in detail as JSON (description_of_the_thing)."
        ask_ten = "Fill in the record as JSON: ten yes/no properties of a red apple."
        speed: dict[str, list[float]] = {k: [] for k in ("free", "long_string", "ten_plain",
                                                          "ten_forced")}
        forced = []
        for _ in range(trials):  # alternating, so a busier moment hits every kind alike
            speed["free"].append(one(session, ask_long, cap, None, "off").usage.decode_tps)
            speed["long_string"].append(
                one(session, ask_long, cap, long_spec, "off").usage.decode_tps)
            speed["ten_plain"].append(
                one(session, ask_ten, cap, ten_spec, "off").usage.decode_tps)
            fast = one(session, ask_ten, cap, ten_spec, "lookup")
            speed["ten_forced"].append(fast.usage.decode_tps)
            forced.append(fast.usage.forced_tokens)
    finally:
        session.close()
    med = {k: benchlib.median(v) for k, v in speed.items()}
    print(f"# {benchlib.machine()}; cap {cap} tokens, greedy; "
          f"{time.perf_counter() - t0:.0f} s")
    benchlib.print_table(["schema", "prompts", "free: parse", "free: valid",
                          "constrained: parse", "constrained: valid"], rows)
    benchlib.print_table(
        ["decode", "tok/s (median)", "ratio"],
        [["free, one long string field asked", med["free"], 1.0],
         ["constrained by it (mask every token)", med["long_string"],
          benchlib.ratio(med["long_string"], med["free"])],
         ["ten long field names, constrained plain", med["ten_plain"], 1.0],
         ["same, forced tokens + lookup", med["ten_forced"],
          benchlib.ratio(med["ten_forced"], med["ten_plain"])]])
    total = {how: sum(v[how]["valid"] for v in validity.values()) for how in
             ("free", "constrained")}
    benchlib.print_json({
        "bench": "structured", "mode": benchlib.mode(args), "model": args.model or "default",
        "machine": benchlib.machine(), "cap": cap, "prompts_per_schema": n,
        "validity": validity, "valid_total": total, "replies": n * len(SCHEMAS),
        "decode_tps": med, "trials": trials, "forced_tokens": forced,
        "mask_ratio": benchlib.ratio(med["long_string"], med["free"]),
        "forced_ratio": benchlib.ratio(med["ten_forced"], med["ten_plain"])})


if __name__ == "__main__":
    main()
