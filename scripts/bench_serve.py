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

Then many clients at once (issue 32): aggregate decode tok/s of 1/2/4/8 streaming clients at
once against the same requests one at a time (each timed alone; every reply compared with its
lone reply), for replies of a few lines (they end at different lengths) and replies that run
to the cap (every stream decodes the whole run), and
the inter-token gaps of three running streams while a ~LONG-token prompt arrives and is
prefilled (median and max) against their gaps without it.

Usage: python scripts/bench_serve.py [--quick | --smoke] [-m MODEL] [--stored N] [--clients-only]
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

    def __init__(self, kind: str, model: str, home: Path, *args: str):
        self.kind, self.model, self.home, self.args = kind, model, home, args

    def start(self) -> Server:
        env = {**os.environ, "LOCALCHAT_HOME": str(self.home)}
        if self.kind == "localchat":
            cmd = benchlib.localchat("serve", "-m", self.model, "--port", "0", *self.args)
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

    def ask(self, messages: list[dict], max_tokens: int, times: list | None = None
            ) -> tuple[str, float, int]:
        """(reply, seconds to the first streamed text, cached tokens if the server says);
        ``times``: gets the clock of every streamed piece."""
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
                    if piece and times is not None:
                        times.append(time.perf_counter())
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
    ap.add_argument("--clients-only", action="store_true",
                    help="only the many-clients part (aggregate tok/s, gaps)")
    ap.add_argument("--clients", default=None, metavar="N,N,…",
                    help="client counts to run at once (default 1,2,4,8)")
    ap.add_argument("--client-tokens", type=int, default=None, metavar="N",
                    help="reply tokens per client (default 48; --quick 32)")
    ap.add_argument("--speculate", choices=["off", "lookup"], default=None,
                    help="the many-clients servers' --speculate (default: theirs, lookup: a "
                         "greedy request running alone drafts; off: batching alone compared)")
    args = ap.parse_args()
    trials = benchlib.pick(args, 3, 2, 1)
    turns = benchlib.pick(args, 5, 4, 3)
    history_tokens = benchlib.pick(args, 1024, 1024, 96)
    stored = args.stored if args.stored is not None else benchlib.pick(args, 2000, 2000, 50)
    max_tokens = benchlib.pick(args, 32, 32, 8)
    home = benchlib.scratch_home()
    import localchat.cpu.backend as backend

    backend.prepare()
    from localchat.model.engine import Engine
    from localchat.model.resolve import resolve

    ref = resolve(args.model)
    model = str(ref.path)
    engine = Engine.load(model)
    first = benchlib.filler_messages(engine, history_tokens)[0]["content"] + " Plan my trip."
    rows, record = [], {}
    clients = many_clients(args, engine, model, home)
    if args.clients_only:
        print_clients(args, ref.name, clients)
        return
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
    print()
    print_clients(args, ref.name, clients, json_line=False)
    benchlib.print_json({"bench": "serve", "mode": benchlib.mode(args), "model": ref.name,
                         "machine": benchlib.machine(), "turns": turns,
                         "history_tokens": history_tokens, **record, **clients})


# -- many clients at once ----------------------------------------------------------------------

CLIENT_TOPICS = ["Seoul", "Paris", "the sea", "rain", "Busan", "mountains", "trains", "tea"]


def at_once(server: Server, chats: list[list[dict]], max_tokens: int,
            times: list[list] | None = None) -> tuple[list[str], float]:
    """Every chat streamed at once (a thread each): (replies, wall seconds)."""
    import threading

    out: list = [None] * len(chats)

    def one(i: int) -> None:
        out[i] = server.ask(chats[i], max_tokens, times[i] if times else None)[0]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(chats))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def many_clients(args, engine, model: str, home: Path) -> dict:
    """Aggregate tok/s of N clients at once vs the same requests one at a time, and the
    running streams' inter-token gaps while a long prompt is prefilled."""
    sizes = [int(n) for n in args.clients.split(",")] if args.clients else \
        benchlib.pick(args, [1, 2, 4, 8], [1, 2, 4, 8], [2])
    max_tokens = args.client_tokens or benchlib.pick(args, 48, 32, 8)
    long_tokens = benchlib.pick(args, 2048, 2048, 100)
    trials = benchlib.pick(args, 2, 1, 1)
    # Two sets of requests: replies that end where the model ends them (a few lines: their
    # lengths differ, and the longest runs alone at the end), and replies that all run to
    # the cap (a long story: every stream decodes for the whole run, as in the figure).
    sets = {"few lines": "tell me about {} in a few lines.",
            "to the cap": "write a long story about {}."}
    if args.smoke:
        sets = dict(list(sets.items())[:1])
    chats = {name: [f"Question {i}: " + ask.format(CLIENT_TOPICS[i % len(CLIENT_TOPICS)])
                    for i in range(8)] for name, ask in sets.items()}
    spec = ("--speculate", args.speculate) if args.speculate else ()
    # Every (set, clients, trial) run sends requests no run before it sent (k trailing
    # spaces): a request seen before would find its prompt cached. Each is answered alone
    # first, on a server of its own, and timed: "one at a time" is the sum of exactly those.
    runs = [(name, n, t) for name in sets for n in sizes for t in range(trials)]
    texts = {(name, n, t): [c + " " * k for c in chats[name][:n]]
             for k, (name, n, t) in enumerate(runs)}
    lone = Server("localchat", model, home / "clients-lone", "--max-batch", "1", *spec).start()
    reference: dict = {}  # (set, n, t) -> [(reply, seconds alone)]
    try:
        lone.ask([{"role": "user", "content": "warm-up"}], 4)
        for run in runs:
            reference[run] = []
            for text in texts[run]:
                t0 = time.perf_counter()
                reply = lone.ask([{"role": "user", "content": text}], max_tokens)[0]
                reference[run].append((reply, time.perf_counter() - t0))
    finally:
        lone.stop()
    out = {"client_max_tokens": max_tokens, "speculate": args.speculate,
           "request_sets": sets}
    server = Server("localchat", model, home / "clients", "--max-batch", "8", *spec).start()
    try:
        at_once(server, [[{"role": "user", "content": f"warm-up {i}"}] for i in range(2)], 4)
        for name in sets:
            key = "clients" if name == "few lines" else "clients_to_cap"
            out[key] = {}
            for n in sizes:
                out[key][str(n)] = clients_at_once(server, engine, max_tokens, [
                    (texts[name, n, t], reference[name, n, t]) for t in range(trials)])
        out["gaps"] = gaps(server, engine, [[{"role": "user", "content": c}]
                                            for c in chats["few lines"][:3]],
                           long_tokens, benchlib.pick(args, 96, 64, 12))
    finally:
        server.stop()
    return out


def clients_at_once(server: Server, engine, max_tokens: int, trials: list) -> dict:
    """One row: ``trials`` of (the requests, their lone (reply, seconds)) sent at once."""
    walls, seqs, tokens, equal, unequal = [], [], [], True, []
    for t, (texts, alone) in enumerate(trials):
        replies, wall = at_once(server, [[{"role": "user", "content": x}] for x in texts],
                                max_tokens)
        walls.append(wall)
        seqs.append(sum(sec for _, sec in alone))
        # (decoded text re-encoded: ~tokens)
        tokens.append([len(engine.encode(r)) for r, _ in alone])
        for i, (got, (want, _)) in enumerate(zip(replies, alone)):
            if got != want:
                equal = False
                unequal.append({"trial": t, "request": i, "alone": want, "at_once": got})
    wall, seq = benchlib.median(walls), benchlib.median(seqs)
    tok = benchlib.median([sum(x) for x in tokens])
    return {"wall_s": round(wall, 3), "one_at_a_time_s": round(seq, 3),
            "aggregate_tps": round(tok / wall, 2), "one_at_a_time_tps": round(tok / seq, 2),
            "speedup": round(benchlib.median([s / w for s, w in zip(seqs, walls)]), 2),
            "reply_tokens": tokens[0], "replies_equal": equal, "unequal": unequal}


def gaps(server: Server, engine, chats: list[list[dict]], long_tokens: int, max_tokens: int
         ) -> dict:
    """Inter-token gaps of three streams: alone, and while a ``long_tokens`` prompt arrives
    (sent once they stream, its prefill interleaved with their decode steps)."""
    import threading

    def run(with_long: bool, tag: str) -> tuple[list[float], float, float]:
        times: list[list] = [[] for _ in chats]
        batch = [[{"role": "user", "content": c[0]["content"] + tag}] for c in chats]
        window = [0.0, 0.0]

        def long_one() -> None:
            while sum(len(t) for t in times) < 6:  # the three stream
                time.sleep(0.01)
            text = benchlib.filler_messages(engine, long_tokens)[0]["content"] + tag
            window[0] = time.perf_counter()
            server.ask([{"role": "user", "content": text}], 2)
            window[1] = time.perf_counter()

        helper = threading.Thread(target=long_one) if with_long else None
        if helper:
            helper.start()
        at_once(server, batch, max_tokens, times)
        if helper:
            helper.join()
        lo, hi = window if with_long else (0.0, float("inf"))
        out = [b - a for t in times for a, b in zip(t, t[1:]) if lo <= b and a <= hi]
        return out, *window

    base, _, _ = run(False, " (plain)")
    during, t0, t1 = run(True, " (long prompt)")
    med = benchlib.median
    return {"long_prompt_tokens": long_tokens, "median_gap_s": round(med(base), 4),
            "max_gap_s": round(max(base), 4),
            "median_gap_long_s": round(med(during), 4) if during else None,
            "max_gap_long_s": round(max(during), 4) if during else None,
            "long_prompt_s": round(t1 - t0, 3),
            "median_gap_ratio": round(med(during) / med(base), 2) if during else None}


def print_clients(args, name: str, r: dict, json_line: bool = True) -> None:
    print(f"# many clients at once · {name} · {r['client_max_tokens']} tokens each · "
          f"--speculate {args.speculate or 'as the server defaults (lookup)'} · "
          f"{benchlib.machine()}")
    rows = [[n, name, "/".join(map(str, c["reply_tokens"])), f"{c['wall_s']:.2f} s",
             f"{c['one_at_a_time_s']:.2f} s", f"{c['aggregate_tps']:.1f}",
             f"{c['one_at_a_time_tps']:.1f}", f"{c['speedup']:.2f}x", c["replies_equal"]]
            for key, name in (("clients", "few lines"), ("clients_to_cap", "to the cap"))
            for n, c in r.get(key, {}).items()]
    benchlib.print_table(["clients", "replies", "tokens", "at once", "one at a time",
                          "agg tok/s", "seq tok/s", "speedup", "= lone"], rows)
    g = r["gaps"]
    print(f"# three streams' inter-token gaps: alone median {g['median_gap_s'] * 1e3:.0f} ms "
          f"(max {g['max_gap_s'] * 1e3:.0f}); while a {g['long_prompt_tokens']}-token prompt "
          f"is prefilled ({g['long_prompt_s']:.2f} s) median "
          f"{(g['median_gap_long_s'] or 0) * 1e3:.0f} ms (max "
          f"{(g['max_gap_long_s'] or 0) * 1e3:.0f}): {g['median_gap_ratio']}x")
    if json_line:
        benchlib.print_json({"bench": "serve", "mode": benchlib.mode(args), "model": name,
                             "machine": benchlib.machine(), **r})


def fill(home: Path, model: str, n: int) -> None:
    """``n`` stored caches: conversations of varied first messages (each a real turn of the
    first few, then forks of their caches with other names, as a long-used folder holds)."""
    os.environ["LOCALCHAT_HOME"] = str(home)
    from localchat import paths
    from localchat.kvcache.folder import CacheFolder
    from localchat.session.session import TurnOptions, open_session

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
