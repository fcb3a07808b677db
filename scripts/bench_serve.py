"""``localchat serve`` against ``mlx_lm.server``: time to first token of turn N, side by side.

On the default model (or -m MODEL), in one run, the same greedy chat (a ~HISTORY-token first
message, then short turns) through the OpenAI API, streaming, each turn re-sending the
history as clients do:
- localchat serve, turn after turn (the cache of turn N-1 is on disk);
- localchat serve after a restart, turn N (the cache comes back from disk);
- the first turn with nothing stored (its whole ~HISTORY-token message prefilled: about what
  turn N costs without a cache);
- mlx_lm.server (its in-memory prompt cache), turn after turn, and turn N after its restart;
  run with the same BLAS localchat loads (stock ``mlx[cpu]`` is ~20x slower on a CPU).
Then the prefix index at scale: a new conversation's TTFT with STORED caches on disk vs an
empty store, through the server and through ``localchat ask``. mlx_lm.server runs a float32
copy of a quantized model (``mlx_lm convert -d``), as localchat's CPU path does.

Usage: python scripts/bench_serve.py [--quick | --smoke] [-m MODEL] [--stored N]
``--quick``: 2 trials, 4 turns. ``--smoke``: 1 trial, 3 turns, 50 stored caches, every step
in seconds on a tiny model (``tests/test_scripts.py`` runs it); its figures mean nothing.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

TURNS = ["Tell me more about the second point.", "And what would you pack?",
         "Which day is best for the museum?", "Summarise the plan in one line."]


class Server:
    """A chat-completions server in a child process: ``localchat serve`` or
    ``mlx_lm.server`` (with localchat's BLAS loaded first)."""

    def __init__(self, kind: str, model: str, home: Path):
        self.kind, self.model, self.home = kind, model, home

    def start(self) -> Server:
        env = {**os.environ, "LOCALCHAT_HOME": str(self.home)}
        if self.kind == "localchat":
            cmd = benchlib.localchat("serve", "-m", self.model, "--port", "0")
            self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
            for line in self.proc.stderr:
                if m := re.search(r"on http://127.0.0.1:(\d+)/v1", line):
                    self.port = int(m.group(1))
                    break
            else:
                raise SystemExit("localchat serve did not start")
        else:
            self.port = free_port()
            code = ("from localchat.cpu import backend; backend.prepare(); import runpy, sys; "
                    "sys.argv = ['mlx_lm.server'] + sys.argv[1:]; "
                    "runpy.run_module('mlx_lm.server', run_name='__main__')")
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, "--model", self.model, "--port", str(self.port)],
                env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2)
                    break
                except OSError:
                    time.sleep(0.3)
            else:
                raise SystemExit("mlx_lm.server did not start")
        return self

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def ask(self, messages: list[dict], max_tokens: int) -> tuple[str, float, int]:
        """(reply, seconds to the first streamed text, cached tokens if the server says)."""
        body = {"model": self.model if self.kind != "localchat" else "localchat",
                "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        t0, first, text, cached = time.perf_counter(), None, "", -1
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and first is None:
                        first = time.perf_counter() - t0
                    text += piece
                usage = chunk.get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
        return text, first if first is not None else time.perf_counter() - t0, cached


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def turn_n(kind: str, model: str, home: Path, first: str, turns: int, max_tokens: int,
           restart: bool) -> tuple[float, int]:
    """(TTFT, cached tokens) of the last of ``turns`` turns of a chat, history re-sent each
    time; ``restart``: the server is restarted before that last turn."""
    server = Server(kind, model, home).start()
    history = []
    try:
        for i in range(turns):
            history.append({"role": "user", "content": first if i == 0 else TURNS[i - 1]})
            if i == turns - 1:
                if restart:
                    server.stop()
                    server = Server(kind, model, home).start()
                _, ttft, cached = server.ask(history, max_tokens)
                return ttft, cached
            history.append({"role": "assistant", "content": server.ask(history, max_tokens)[0]})
    finally:
        server.stop()
    raise AssertionError("no turns")


def dequantized(model: str, home: Path) -> str:
    """A float32 copy of ``model`` (what localchat's CPU path runs) for mlx_lm.server: stock
    MLX has no fast CPU path for quantized matmuls."""
    config = json.loads((Path(model) / "config.json").read_text())
    if "quantization" not in config:
        return model
    out = home / "mlx-lm-model"
    benchlib.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", model,
                  "--mlx-path", str(out), "-d", "--dtype", "float32"])
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "2 trials, 4 turns")
    ap.add_argument("--stored", type=int, default=None, metavar="N",
                    help="stored caches for the index's scale test (default 2000)")
    args = ap.parse_args()
    trials = benchlib.pick(args, 3, 2, 1)
    turns = benchlib.pick(args, 5, 4, 3)
    history_tokens = benchlib.pick(args, 1024, 1024, 96)
    stored = args.stored if args.stored is not None else benchlib.pick(args, 2000, 2000, 50)
    max_tokens = benchlib.pick(args, 32, 32, 8)
    home = benchlib.scratch_home()
    import localchat.cpu.backend as backend

    backend.prepare()
    from localchat.engine import Engine
    from localchat.models import resolve

    ref = resolve(args.model)
    model = str(ref.path)
    engine = Engine.load(model)
    first = benchlib.filler_messages(engine, history_tokens)[0]["content"] + " Plan my trip."
    rows, record = [], {}
    theirs_model = dequantized(model, home)
    cases = {}
    for t in range(trials):
        for kind, name in (("localchat", model), ("mlx_lm", theirs_model)):
            for restart in (False, True):
                run_home = home / f"{kind}-{t}-{restart}"
                run_home.mkdir()
                cases.setdefault((kind, restart), []).append(turn_n(
                    kind, name, run_home, f"{first} (trial {t})", turns, max_tokens, restart))
        run_home = home / f"empty-{t}"  # turn N with nothing stored: a full prefill
        run_home.mkdir()
        cases.setdefault(("empty", False), []).append(turn_n(
            "localchat", model, run_home, f"{first} (trial {t})", 1, max_tokens, False))
    med = benchlib.median

    def ttft(key) -> float:
        return med([c[0] for c in cases[key]])

    live, restarted = ttft(("localchat", False)), ttft(("localchat", True))
    their_live, their_restarted = ttft(("mlx_lm", False)), ttft(("mlx_lm", True))
    full = ttft(("empty", False))
    rows += [
        [f"turn {turns}, live", f"{live:.3f} s", f"{their_live:.3f} s",
         f"{benchlib.ratio(their_live, live):.2f}x", cases[("localchat", False)][0][1]],
        [f"turn {turns} after a restart", f"{restarted:.3f} s", f"{their_restarted:.3f} s",
         f"{benchlib.ratio(their_restarted, restarted):.2f}x",
         cases[("localchat", True)][0][1]],
        ["turn 1 alone (nothing stored: a full prefill of the first message)",
         f"{full:.3f} s", "", "", 0],
    ]
    record.update(turn_live_s=live, mlx_lm_turn_live_s=their_live, turn_restart_s=restarted,
                  mlx_lm_turn_restart_s=their_restarted, turn1_full_prefill_s=full,
                  cached_live=cases[("localchat", False)][0][1],
                  cached_restart=cases[("localchat", True)][0][1])

    # The prefix index at scale: STORED caches on disk, a new conversation's first turn.
    scale_home = home / "scale"
    scale_home.mkdir()
    os.environ["LOCALCHAT_HOME"] = str(scale_home)
    probe = "What is the best season to visit Jeju?"
    ask = benchlib.localchat("ask", "-m", model, "--json", "--max-tokens", "4", probe)

    def ask_ttft() -> float:
        return json.loads(benchlib.run(ask).stdout)["usage"]["ttft_s"]

    def serve_ttft() -> float:
        s = Server("localchat", model, scale_home).start()
        try:
            s.ask([{"role": "user", "content": probe}], 4)  # warm-up
            return med([s.ask([{"role": "user", "content": f"{probe} ({i})"}], 4)[1]
                        for i in range(trials * 2)])
        finally:
            s.stop()

    before = (med([ask_ttft() for _ in range(trials)]), serve_ttft())
    fill(scale_home, model, stored)
    after = (med([ask_ttft() for _ in range(trials)]), serve_ttft())
    rows += [[f"new conversation, ask: empty store vs {stored} caches", f"{before[0]:.3f} s",
              f"{after[0]:.3f} s", f"{benchlib.ratio(after[0], before[0]):.2f}x", ""],
             [f"new conversation, serve: empty vs {stored} caches", f"{before[1]:.3f} s",
              f"{after[1]:.3f} s", f"{benchlib.ratio(after[1], before[1]):.2f}x", ""]]
    record.update(stored=stored, ask_empty_s=before[0], ask_stored_s=after[0],
                  serve_empty_s=before[1], serve_stored_s=after[1])
    print(f"# localchat serve vs mlx_lm.server · {ref.name} · ~{history_tokens}-token first "
          f"message, {turns} turns · {benchlib.machine()} · median of {trials}")
    print("(rows 1-3: TTFT localchat | mlx_lm.server | mlx_lm / localchat | cached tokens; "
          "rows 4-5: before | after | after / before)")
    benchlib.print_table(["case", "localchat", "mlx_lm.server / after", "ratio", "cached"],
                         rows)
    benchlib.print_json({"bench": "serve", "mode": benchlib.mode(args), "model": ref.name,
                         "machine": benchlib.machine(), "turns": turns,
                         "history_tokens": history_tokens, **record})


def fill(home: Path, model: str, n: int) -> None:
    """``n`` stored caches: conversations of varied first messages (each a real turn of the
    first few, then forks of their caches with other names, as a long-used folder holds)."""
    os.environ["LOCALCHAT_HOME"] = str(home)
    from localchat import paths
    from localchat.kvcache.folder import CacheFolder
    from localchat.session import TurnOptions, open_session

    session = open_session(model)
    seeds = []
    for i in range(min(n, 20)):
        conv = session.conversation(f"seed-{i}")
        text = benchlib.FILLER[: 40 + 13 * i] + f" Topic {i}."
        list(session.turn(conv, text, TurnOptions(max_tokens=4)))
        seeds.append(conv)
    for i in range(len(seeds), n):
        src = CacheFolder(paths.kv_root() / str(seeds[i % len(seeds)].id))
        man = src.manifest()
        CacheFolder(paths.kv_root() / f"{100000 + i}").adopt(src, man, len(man.tokens))
    session.close()


if __name__ == "__main__":
    main()
