"""A real client no one here wrote, past the context: the `llm` CLI against `localchat serve`.

Issue 35's session, repeated: `localchat serve --context-overflow truncate` in a scratch data
folder, and `llm` (simonw/llm, its own `LLM_USER_PATH` with an `extra-openai-models.yaml`
naming the server) with no options: `llm -m localchat "What is the capital of France?"`,
`llm -c "And of Korea? One word."`, then `llm -c` with long messages (English and Korean
paragraphs, ``--tokens`` each), each followed by a short question, until the conversation has
passed the context more than once.
Per turn, from the server's log line: cached / prefilled / reply tokens, seconds, the miss
reason; and whether the reply holds a special token (``<|…|>``) or the request was refused.

Usage: python scripts/check_llm_client.py --llm /path/to/llm [-m MODEL] [--turns N]
       [--tokens N] [--reply-cap N]
The first two turns send no options; ``--reply-cap`` bounds the later replies (``-o
max_tokens N``: a busy CPU decodes a few tokens a second).
Needs `llm` installed apart (``pip install llm`` in a venv of its own; not a localchat
dependency). Prints a table, then one JSON line; exits 1 if a turn was refused or showed a
special token, or turn 1 did not end on its own.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402
from bench_edges import counter, message  # noqa: E402

LOG = re.compile(r"cached (\d+) / prefilled (\d+) · gen (\d+) · TTFT ([\d.]+)s · decode "
                 r"([\d.]+) tok/s(?: · (.*))?")
ASKS = ("Summarize the text above in one sentence.", "위 글을 한 문장으로 요약해 주세요.")
FOLLOW = ("Thanks. Which place did it name first? One word.",
          "고마워요. 처음에 나온 도시는 어디였나요? 한 단어로.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llm", required=True, help="the llm executable")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--turns", type=int, default=5,
                    help="long messages after the first two turns (each then a short one)")
    ap.add_argument("--tokens", type=int, default=2500, help="tokens of each long message")
    ap.add_argument("--reply-cap", type=int, default=0, metavar="N",
                    help="max_tokens of the turns after the first two (default: none sent)")
    args = ap.parse_args()
    home = benchlib.scratch_home()
    user = Path(tempfile.mkdtemp(prefix="llm-user-"))
    atexit.register(shutil.rmtree, user, ignore_errors=True)
    port = free_port()
    (user / "extra-openai-models.yaml").write_text(
        f"- model_id: localchat\n  model_name: localchat\n"
        f"  api_base: \"http://127.0.0.1:{port}/v1\"\n")
    env = {**os.environ, "LLM_USER_PATH": str(user)}
    log_path = home / "serve.log"
    cmd = benchlib.localchat("serve", "--port", str(port), "--context-overflow", "truncate",
                             *(["-m", args.model] if args.model else []))
    server = subprocess.Popen(cmd, stderr=log_path.open("w"), stdout=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        count = counter(args.model)
        prompts = ["What is the capital of France?", "And of Korea? One word."]
        for i in range(args.turns):  # a long message, then a short one that appends to it
            korean = i % 2 == 1
            text = message(count, args.tokens, 10 + i, korean=0.9 if korean else 0.25)
            prompts += [f"{text}\n\n{ASKS[korean]}", FOLLOW[korean]]
        rows, turns = [], []
        seen = 0
        for i, prompt in enumerate(prompts):
            call = [args.llm, "-m", "localchat", prompt] if i == 0 else [args.llm, "-c", prompt]
            if i >= 2 and args.reply_cap:
                call += ["-o", "max_tokens", str(args.reply_cap)]
            t0 = time.perf_counter()
            out = subprocess.run(call, env=env, capture_output=True, text=True, timeout=3600)
            seconds = time.perf_counter() - t0
            lines = log_path.read_text().splitlines()
            new, seen = lines[seen:], len(lines)
            found = [m for m in map(LOG.search, new) if m]
            turn = {"turn": i + 1, "message_tokens": count(prompt), "rc": out.returncode,
                    "seconds": round(seconds, 1), "reply_chars": len(out.stdout),
                    "special_token": bool(re.search(r"<\|[a-z_]+\|>", out.stdout)),
                    "error": out.stderr.strip()[-300:] if out.returncode else ""}
            if found:
                c, p, g, ttft, tps, why = found[-1].groups()
                turn.update(cached=int(c), prefilled=int(p), prompt=int(c) + int(p),
                            reply_tokens=int(g), ttft_s=float(ttft), decode_tps=float(tps),
                            miss_reason=why or "")
            turns.append(turn)
            rows.append([turn["turn"], turn["message_tokens"], turn.get("prompt", "-"),
                         turn.get("cached", "-"), turn.get("prefilled", "-"),
                         turn.get("reply_tokens", "-"), turn["seconds"],
                         "yes" if turn["special_token"] else "no",
                         turn["error"][:60] or turn.get("miss_reason", "") or "-"])
            print(f"turn {i + 1}: {json.dumps(turn, ensure_ascii=False)}", file=sys.stderr,
                  flush=True)
            if i < 2:
                print(f"turn {i + 1} reply: {out.stdout.strip()[:300]!r}", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=60)
    listed = json.loads(benchlib.run(benchlib.localchat("list", "--json")).stdout)
    # What the client itself recorded: each response's finish reason (``llm logs``).
    logged = json.loads(subprocess.run([args.llm, "logs", "--json", "-n", "0"], env=env,
                                       capture_output=True, text=True).stdout or "[]")
    finishes = [(r.get("response_json") or {}).get("finish_reason") for r in logged]
    for turn, finish in zip(turns, finishes):
        turn["finish_reason"] = finish
    print(f"# {benchlib.machine()}")
    for row, turn in zip(rows, turns):
        row.insert(6, turn.get("finish_reason") or "-")
    benchlib.print_table(["turn", "message", "prompt", "cached", "prefilled", "reply",
                          "finish", "s", "special", "error / miss reason"], rows)
    checks = {
        # (a reply cut at the cap or in a loop says "length")
        "turn1_ends_on_its_own": turns[0].get("finish_reason") == "stop",
        # Every turn but a cut one caches what the one before it left: its prompt and reply
        # (a re-tokenized reply may differ in its last token or two).
        "appends_between_cuts": all(
            t.get("cached", 0) >= prev.get("prompt", 0) + prev.get("reply_tokens", 0) - 2
            for prev, t in zip(turns, turns[1:]) if "context full" not in t.get("miss_reason",
                                                                                 "")),
        "no_special_token": not any(t["special_token"] for t in turns),
        "none_refused": all(t["rc"] == 0 for t in turns),
        "one_conversation": len(listed) == 1,
    }
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    benchlib.print_json({"bench": "llm_client", "model": args.model or "default",
                         "machine": benchlib.machine(), "turns": turns,
                         "conversations": [c.get("name") for c in listed], "checks": checks})
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
