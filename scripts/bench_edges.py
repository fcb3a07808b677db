"""A conversation that fills the context goes on: issue 35's `ask` check, measured.

On the default model (or -m MODEL), through the command line as a user runs it, in a scratch
data folder: `localchat ask` with a first message of ~80% of the context (6,500 of the default
model's 8,192 tokens) and a second of ~25% (2,000), then a short third question; and the same
third turn with `--no-cache` on a fork made before it. Checked and printed:
- the second turn answers, with the notice of what it left out (`context full: …`) on stderr
  and in `usage.miss_reason`;
- `localchat show` still holds every message, as sent;
- the third turn caches at least the second's prompt + reply − 2 tokens (the window moved
  once and then appends) and its greedy reply equals the `--no-cache` one.
Per turn: prompt / cached / prefilled / reply tokens and seconds.

Usage: python scripts/bench_edges.py [--quick | --smoke] [-m MODEL] [--max-tokens N]
``--quick`` is the full run (one trial is the check). ``--smoke``: messages of 800 and 250
tokens and 24-token replies, for a tiny model with a 1,024-token context
(``tests/test_scripts.py``); its figures mean nothing.
Prints a table, then one JSON line; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

NAME = "edges"
THIRD = "In one sentence: what was my last message about?"

# Sentences of both scripts our users write, put together at random so that a long message is
# not one phrase repeated (a model copies a repeated phrase, which says little about a reply).
SUBJECTS = ("The committee", "My neighbour", "The new library", "Our team", "The old bridge",
            "A small bakery", "The river", "Every student", "The night train", "The garden")
VERBS = ("planned", "rebuilt", "described", "questioned", "painted", "measured", "forgot",
         "celebrated", "moved", "explained")
OBJECTS = ("the spring festival", "a budget for the harbour", "the story of the village",
           "three hundred chairs", "the route over the mountains", "a letter to the mayor",
           "the broken clock", "the results of the survey", "a quiet afternoon",
           "the map of the islands")
KOREAN = ("서울의 날씨는 오늘 맑고 따뜻합니다.", "다음 주에는 부산에 가서 바다를 볼 계획입니다.",
          "도서관은 아홉 시에 문을 엽니다.", "우리는 기차표를 미리 예매했습니다.",
          "시장에서 신선한 과일을 샀습니다.", "회의는 오후 세 시에 시작합니다.",
          "그 다리는 백 년 전에 지어졌습니다.", "아이들이 공원에서 축구를 합니다.")


def message(count, n_tokens: int, seed: int, korean: float = 0.25) -> str:
    """Paragraphs of English and Korean sentences (``korean`` of them Korean), ``n_tokens``
    tokens long (``count``)."""
    rnd = random.Random(seed)
    parts: list[str] = []
    while True:
        sentence = (rnd.choice(KOREAN) if rnd.random() < korean else
                    f"{rnd.choice(SUBJECTS)} {rnd.choice(VERBS)} {rnd.choice(OBJECTS)}.")
        if count(" ".join([*parts, sentence])) > n_tokens:
            return " ".join(parts)
        parts.append(sentence + ("\n\n" if rnd.random() < 0.15 else ""))


def counter(model: str | None):
    """Tokens a text is (the model's tokenizer.json; the template adds a few per message)."""
    from tokenizers import Tokenizer

    from localchat.model.resolve import resolve

    tok = Tokenizer.from_file(str(resolve(model).path / "tokenizer.json"))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def ask(model_args: list[str], text: str, *extra: str) -> tuple[dict, str, float]:
    """One `localchat ask --json` turn: its JSON, its stderr and its seconds."""
    import subprocess

    cmd = benchlib.localchat("ask", *model_args, "--json", *extra, "-")
    t0 = time.perf_counter()
    out = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"ask {' '.join(extra)}: exit status {out.returncode}: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "the same as the full run (one trial is the check)")
    ap.add_argument("--max-tokens", type=int, default=0, metavar="N",
                    help="each reply's cap (default: ask's own, 1,024)")
    args = ap.parse_args()
    first, second = benchlib.pick(args, (6500, 2000), (6500, 2000), (800, 250))
    cap = benchlib.pick(args, [], [], ["--max-tokens", "24"])  # full: ask's own cap
    if args.max_tokens:
        cap = ["--max-tokens", str(args.max_tokens)]
    benchlib.scratch_home()
    model_args = ["-m", args.model] if args.model else []
    count = counter(args.model)
    texts = [message(count, first, 1), message(count, second, 2)]

    turns: list[dict] = []
    notices: list[str] = []
    for i, text in enumerate(texts + [THIRD]):
        if i == 2:  # the copy the third turn is compared with, made before it
            benchlib.run(benchlib.localchat("fork", NAME, f"{NAME}-copy"))
        out, err, seconds = ask(model_args + ["-c", NAME], text, *cap)
        turns.append({**out["usage"], "seconds": round(seconds, 1), "reply": out["reply"]})
        notices.append(" | ".join(line for line in err.splitlines() if "context full" in line))
    copy, _, copy_s = ask(model_args + ["-c", f"{NAME}-copy"], THIRD, "--no-cache", *cap)
    shown = json.loads(benchlib.run(benchlib.localchat("show", NAME, "--json")).stdout)[
        "messages"]
    sent = [texts[0], turns[0]["reply"], texts[1], turns[1]["reply"], THIRD, turns[2]["reply"]]

    need = turns[1]["prompt_tokens"] + turns[1]["completion_tokens"] - 2
    checks = {
        "turn2_notice": bool(notices[1]) and "left out" in turns[1]["miss_reason"],
        "turn1_no_notice": not notices[0],
        "all_messages_shown": [m["content"] for m in shown] == sent,
        "turn3_cached_enough": turns[2]["cached_tokens"] >= need,
        "turn3_no_notice": not notices[2],
        "turn3_equals_no_cache": turns[2]["reply"] == copy["reply"],
    }
    rows = [[f"turn {i + 1}", t["prompt_tokens"], t["cached_tokens"], t["prefilled_tokens"],
             t["completion_tokens"], t["seconds"], t["miss_reason"] or "-"]
            for i, t in enumerate(turns)]
    rows.append(["turn 3, --no-cache copy", copy["usage"]["prompt_tokens"],
                 copy["usage"]["cached_tokens"], copy["usage"]["prefilled_tokens"],
                 copy["usage"]["completion_tokens"], round(copy_s, 1),
                 copy["usage"]["miss_reason"] or "-"])
    print(f"# {benchlib.machine()}")
    print(f"# messages: {first} and {second} tokens of text, then {THIRD!r}; "
          f"turn 2 said: {notices[1] or 'nothing'}")
    benchlib.print_table(["turn", "prompt", "cached", "prefilled", "reply", "s", "miss reason"],
                         rows)
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    benchlib.print_json({
        "bench": "edges", "mode": benchlib.mode(args), "model": args.model or "default",
        "machine": benchlib.machine(), "message_tokens": [first, second],
        "max_tokens": int(cap[1]) if cap else 1024,
        "turns": [{k: v for k, v in t.items() if k != "reply"} for t in turns],
        "no_cache_turn3": copy["usage"], "turn3_needed_cached": need,
        "notice": notices[1], "messages_shown": len(shown), "checks": checks})
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
