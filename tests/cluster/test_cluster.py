"""One model split over two ranks on loopback (MLX ring backend), as `--hosts` runs it.

Each `localchat` call here is a fresh set of processes (rank 0 plus a follower), so a second
turn is a restart of every rank. Tiny random models: llama split by heads (tensor parallel)
and qwen3_next split by layers (pipeline: one rank holds the linear-attention layer, whose
state resumes only at checkpoints, the other the full-attention layer).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from families import build_family
from test_control_link import drain

HOSTS = "127.0.0.1,127.0.0.1"
TIMEOUT = 5  # LOCALCHAT_FOLLOWER_TIMEOUT for these tests


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cluster-models")
    return {name: build_family(name, root / name) for name in ("llama", "qwen3_next")}


def _env(home: Path) -> dict:
    return {**os.environ, "LOCALCHAT_HOME": str(home), "LOCALCHAT_FOLLOWER_TIMEOUT":
            str(TIMEOUT), "TOKENIZERS_PARALLELISM": "false"}


def ask(home: Path, model: Path, conv: str, prompt: str, *extra: str, split: str | None = None,
        max_tokens: int = 12) -> dict:
    cmd = [sys.executable, "-m", "localchat", "ask", "-c", conv, "-m", str(model), "--json",
           "--max-tokens", str(max_tokens), *extra, prompt]
    if split:
        cmd += ["--hosts", HOSTS, "--shard", split]
    out = subprocess.run(cmd, env=_env(home), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "[ring]" not in out.stderr, out.stderr
    return json.loads(out.stdout)


def shard_files(home: Path, split: str, rank: int) -> list[Path]:
    root = home / "kv-shards" / f"{split}-2" / f"rank{rank}"
    return sorted(p for p in root.rglob("*") if p.is_file() and p.parent != root)

def assert_partial_reply_kept(home: Path) -> None:
    """Conversation "c" holds the user's "tell me a long story" and the streamed part of the
    reply, marked partial."""
    shown = subprocess.run([sys.executable, "-m", "localchat", "show", "c", "--json"],
                           env=_env(home), capture_output=True, text=True, timeout=60)
    messages = json.loads(shown.stdout)["messages"]
    assert messages[0]["role"] == "user" and messages[0]["content"] == "tell me a long story"
    assert messages[-1]["role"] == "assistant" and messages[-1].get("partial"), messages
    assert len(messages[-1]["content"]) > 0



@pytest.mark.parametrize("family,split", [("llama", "tensor"), ("qwen3_next", "pipeline")])
def test_split_replies_equal_one_process_and_resume_from_every_rank(models, tmp_path, family,
                                                                     split):
    home = tmp_path / "home"
    model = models[family]
    one = [ask(home, model, "one", "hello there one two"),
           ask(home, model, "one", "and now the second turn")]
    two = [ask(home, model, "two", "hello there one two", split=split),
           ask(home, model, "two", "and now the second turn", split=split)]
    assert [t["reply"] for t in two] == [t["reply"] for t in one]
    # Restarted ranks reuse the cache exactly as one process does.
    assert two[1]["usage"]["cached_tokens"] == one[1]["usage"]["cached_tokens"] > 0
    assert two[1]["usage"]["prefilled_tokens"] == one[1]["usage"]["prefilled_tokens"]
    for rank in (0, 1):  # each rank keeps its own shard, with a manifest
        assert any(p.name == "manifest.json" for p in shard_files(home, split, rank)), rank
    # The usage counts every rank's shard: together about the one-process cache.
    shards = sum(p.stat().st_size for r in (0, 1) for p in shard_files(home, split, r))
    assert two[1]["usage"]["cache_bytes"] == shards
    assert 0.8 < shards / one[1]["usage"]["cache_bytes"] < 1.25
    # Negative control: the replies depend on the conversation (the equality means something).
    other = ask(home, model, "three", "a different first message", split=split)
    assert other["reply"] != two[0]["reply"]
    # Deleting the conversation (in one process) removes every rank's shard on this machine.
    def folders(rank: int) -> set[str]:
        return {p.parent.name for p in shard_files(home, split, rank)}

    assert folders(0) == folders(1) and len(folders(0)) == 2  # "two" and "three"
    left = folders(0)
    subprocess.run([sys.executable, "-m", "localchat", "rm", "two"], env=_env(home),
                   check=True, capture_output=True, timeout=60)
    assert len(folders(0)) == len(folders(1)) == 1 and folders(0) < left


@pytest.mark.parametrize("family,split", [("llama", "tensor"), ("qwen3_next", "pipeline")])
def test_damaged_shard_on_one_rank_rebuilds_on_all(models, tmp_path, family, split):
    home = tmp_path / "home"
    model = models[family]
    one = [ask(home, model, "one", "hello there one two"),
           ask(home, model, "one", "and now the second turn")]
    ask(home, model, "two", "hello there one two", split=split)
    damaged = [p for p in shard_files(home, split, 1) if p.suffix == ".safetensors"]
    assert damaged
    for p in damaged:  # flip bytes in the middle of every tensor file of rank 1
        data = bytearray(p.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 16):
            data[i] ^= 0xFF
        p.write_bytes(bytes(data))
    second = ask(home, model, "two", "and now the second turn", split=split)
    assert second["reply"] == one[1]["reply"]
    assert second["usage"]["cached_tokens"] < one[1]["usage"]["cached_tokens"]
    assert "cache" in second["usage"]["miss_reason"]
    # Every rank wrote a good cache again: the next turn resumes in full.
    third_one = ask(home, model, "one", "a third turn")
    third = ask(home, model, "two", "a third turn", split=split)
    assert third["reply"] == third_one["reply"]
    assert third["usage"]["cached_tokens"] == third_one["usage"]["cached_tokens"]


def _followers(home: Path) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if b"localchat.cluster.follower" in cmd and f"LOCALCHAT_HOME={home}".encode() in env:
            found.append(int(d.name))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the follower through /proc")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_follower_lost_mid_reply_one_line_error_and_messages_kept(models, tmp_path, how):
    home = tmp_path / "home"
    cmd = [sys.executable, "-m", "localchat", "ask", "-c", "c", "-m", str(models["llama"]),
           "--max-tokens", "100000", "--hosts", HOSTS, "tell me a long story"]
    proc = subprocess.Popen(cmd, env=_env(home), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        first = proc.stdout.read(1)  # the reply has started streaming
        assert first, proc.stderr.read().decode()
        time.sleep(0.3)
        (pid,) = _followers(home)
        # The control secret came through its stdin: no 64-hex token on its command line.
        assert not re.search(rb"[0-9a-f]{64}", Path(f"/proc/{pid}/cmdline").read_bytes())
        t = time.monotonic()
        os.kill(pid, how)
        out, err = proc.communicate(timeout=TIMEOUT + 15)
        waited = time.monotonic() - t
    finally:
        proc.kill()
        for pid in _followers(home):
            os.kill(pid, signal.SIGKILL)
    err = err.decode()
    lines = [x for x in err.splitlines() if x.strip()]
    assert proc.returncode == 1, err
    assert lines[-1].startswith("localchat: error: rank 1 (127.0.0.1)"), err
    assert "Traceback" not in err and "[ring]" not in err, err
    assert waited < TIMEOUT + 10
    assert_partial_reply_kept(home)


def test_model_that_cannot_split_that_way_is_one_line(models, tmp_path):
    home = tmp_path / "home"
    cmd = [sys.executable, "-m", "localchat", "ask", "-m", str(models["llama"]),
           "--hosts", "127.0.0.1,127.0.0.1,127.0.0.1", "--shard", "tensor", "hi"]
    out = subprocess.run(cmd, env=_env(home), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "localchat: error: --shard tensor: "
        f"{models['llama']} has 4 attention heads and 2 KV heads, not divisible by 3 ranks")
    assert not _followers(home)


def test_chat_app_split_over_two_ranks(models, tmp_path):
    """The app as rank 0: same replies as one process, second turn from every rank's cache."""
    home = tmp_path / "home"
    model = models["qwen3_next"]
    one = [ask(home, model, "one", "hello there one two"),
           ask(home, model, "one", "and now the second turn")]
    helper = Path(__file__).parents[1] / "cluster_app_helper.py"
    out = subprocess.run([sys.executable, str(helper), str(model), "pipeline",
                          "hello there one two", "and now the second turn"],
                         env=_env(home), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["shown"] == [t["reply"] for t in one]
    assert [c for r, c in seen["stored"] if r == "assistant"] == [t["reply"] for t in one]
    assert f"cached {one[1]['usage']['cached_tokens']} /" in seen["status"], seen["status"]


def test_batch_split_over_two_ranks(models, tmp_path):
    home = tmp_path / "home"
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"id": 1, "prompt": "hello there"}\n'
                     '{"id": 2, "prompt": "hello there again"}\n')
    outs = []
    for extra in ([], ["--hosts", HOSTS]):
        out = subprocess.run([sys.executable, "-m", "localchat", "batch", str(lines), "-m",
                              str(models["llama"]), "--max-tokens", "8", *extra],
                             env=_env(home), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        outs.append([json.loads(x) for x in out.stdout.splitlines()])
    assert [r["reply"] for r in outs[1]] == [r["reply"] for r in outs[0]]
    assert outs[1][1]["usage"]["cached_tokens"] == outs[0][1]["usage"]["cached_tokens"] > 0


def test_ctrl_c_stops_every_rank_at_the_same_token(models, tmp_path):
    """Ctrl-C reaches rank 0 only; the ranks agree where to stop, so every rank's cache holds
    the same tokens and the next turn resumes all of them."""
    home = tmp_path / "home"
    model = models["llama"]
    cmd = [sys.executable, "-m", "localchat", "ask", "-c", "c", "-m", str(model),
           "--max-tokens", "100000", "--hosts", HOSTS, "tell me a long story"]
    proc = subprocess.Popen(cmd, env=_env(home), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout.read(1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode()
    assert "Traceback" not in err.decode()
    nxt = ask(home, model, "c", "go on", split="tensor")
    assert nxt["usage"]["miss_reason"] == "", nxt["usage"]
    assert nxt["usage"]["cached_tokens"] > 0
    assert not _followers(home)


def test_hostfile_starts_remote_followers_through_ssh(models, tmp_path):
    """A host reached by ssh (here a stand-in `ssh` that runs the command on this machine):
    the remote launch line (quoting, environment, working folder) starts a working rank."""
    home = tmp_path / "home"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "ssh-calls.txt"
    fake = bin_dir / "ssh"
    fake.write_text(f"#!/bin/bash\n# ssh [-o OPT]... HOST COMMAND\n"
                    f"while [ \"$1\" = -o ]; do shift 2; done\n"
                    f"echo \"$1\" >> {calls}\nshift\nexec env -i PATH=\"$PATH\" bash -c \"$1\"\n")
    fake.chmod(0o755)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]},
                                    {"ssh": "mac2.example", "ips": ["127.0.0.1"]}]))
    model = models["llama"]
    one = ask(home, model, "one", "hello there one two")
    env = {**_env(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "localchat", "ask", "-c", "two", "-m", str(model), "--json",
           "--max-tokens", "12", "--hostfile", str(hostfile), "hello there one two"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["reply"] == one["reply"]
    assert calls.read_text().split() == ["mac2.example"]  # rank 1 only, by its ssh name


class CommandLines:
    """Every process's command line seen while it runs (polled), and the environment of those
    started with ``marker`` in theirs (rank 0, the stand-in ssh and its shell, the follower)."""

    def __init__(self, marker: bytes):
        self.marker, self.seen, self.stop = marker, set(), threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            for d in Path("/proc").iterdir():
                try:
                    if d.name.isdigit():
                        self.seen.add((d / "cmdline").read_bytes())
                        env = (d / "environ").read_bytes()
                        if self.marker in env:
                            self.seen.add(env)
                except OSError:  # gone already, or another user's
                    continue
            time.sleep(0.05)

    def close(self) -> set[bytes]:
        self.stop.set()
        self.thread.join(10)
        return self.seen


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads command lines through /proc")
def test_strangers_on_the_control_port_get_nothing_and_no_command_line_holds_the_secret(
        models, tmp_path):
    """Strangers connect to rank 0's control port before the follower does (the stand-in ssh
    holds it back until they are in): they receive nothing but the challenge's nonce, each is
    dropped with a line in control.log, and the follower still joins without waiting on the
    silent one. The secret, read by the stand-in from its stdin as a remote shell would, is
    on no process's command line, in no environment and in no log."""
    home = tmp_path / "home"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls, secret, go = tmp_path / "ssh-calls.txt", tmp_path / "secret.txt", tmp_path / "go"
    fake = bin_dir / "ssh"
    fake.write_text(f"#!/bin/bash\n# ssh [-o OPT]... HOST COMMAND, the secret on stdin\n"
                    f"while [ \"$1\" = -o ]; do shift 2; done\n"
                    f"printf '%s\\n' \"$*\" > {calls}.new && mv {calls}.new {calls}\n"
                    f"IFS= read -r line\nprintf '%s\\n' \"$line\" > {secret}\n"
                    f"for _ in $(seq 600); do [ -e {go} ] && break; sleep 0.1; done\n"
                    f"shift\nexec env -i PATH=\"$PATH\" bash -c \"$1\" <<< \"$line\"\n")
    fake.chmod(0o755)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]},
                                    {"ssh": "mac2.example", "ips": ["127.0.0.1"]}]))
    env = {**_env(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "localchat", "ask", "-c", "c", "-m", str(models["llama"]),
           "--json", "--max-tokens", "12", "--hostfile", str(hostfile), "hello there one two"]
    watch = CommandLines(f"LOCALCHAT_HOME={home}".encode())
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    strangers, got, readers = [], {}, []
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"--control (\S+)", calls.read_text()
                                  if calls.exists() else "")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        host, port = m.group(1).rsplit(":", 1)
        for name in ("silent", "garbage", "old hello", "wrong proof"):
            s = socket.create_connection((host, int(port)), timeout=10)
            strangers.append(s)
            if name == "garbage":
                s.sendall(b"\x00\xff{{{ GET / HTTP/1.0\n")
            elif name == "old hello":  # what any follower sent before the handshake
                s.sendall(b'{"rank": 1}\n')
            elif name == "wrong proof":
                s.settimeout(10)
                challenge = s.recv(4096)
                nonce = json.loads(challenge)["nonce"]
                s.sendall(json.dumps({"rank": 1, "nonce": nonce, "proof": "0" * 64}).encode()
                          + b"\n")
            readers.append(threading.Thread(target=drain, args=(s, got, name), daemon=True))
            readers[-1].start()
        time.sleep(0.3)
        go.touch()  # the follower may start now
        out, err = proc.communicate(timeout=120)
        for r in readers:
            r.join(30)
    finally:
        proc.kill()
        seen = watch.close()
        for s in strangers:
            s.close()
        for pid in _followers(home):
            os.kill(pid, signal.SIGKILL)
    err = err.decode()
    assert proc.returncode == 0, err
    assert json.loads(out)["reply"] and "Traceback" not in err
    for name, (data, waited) in got.items():  # the nonce at most, never the conversation
        assert [list(json.loads(x)) for x in data.splitlines()] in ([], [["nonce"]]), name
        assert b"hello there" not in data
        assert waited < 5 + 3, name  # LOCALCHAT_FOLLOWER_TIMEOUT 5 caps the hello timeout
    log = (home / "logs" / "control.log").read_text()
    rows = log.splitlines()
    for why in ("not a JSON object", "lacks a rank, a nonce or a proof", "wrong proof"):
        assert any(why in x for x in rows), log
    joined = [i for i, x in enumerate(rows) if "rank 1 joined" in x]
    silent = [i for i, x in enumerate(rows) if "in time" in x]
    assert len(joined) == 1 and all(i > joined[0] for i in silent), log
    key = secret.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert any(b"localchat.cluster.follower" in x for x in seen)  # the poll saw the follower
    assert not [x for x in seen if key.encode() in x]
    assert key not in log and key not in (home / "logs" / "follower-rank1.log").read_text()
    assert calls.read_text().split()[0] == "mac2.example"


def test_fork_shares_every_rank_shard(models, tmp_path):
    home = tmp_path / "home"
    model = models["qwen3_next"]

    def fork(src: str, dst: str) -> None:
        subprocess.run([sys.executable, "-m", "localchat", "fork", src, dst], env=_env(home),
                       check=True, capture_output=True, timeout=60)

    ask(home, model, "one", "hello there one two")
    fork("one", "one-b")
    one = ask(home, model, "one-b", "and now the second turn")
    ask(home, model, "two", "hello there one two", split="pipeline")
    fork("two", "two-b")
    two = ask(home, model, "two-b", "and now the second turn", split="pipeline")
    assert two["reply"] == one["reply"]
    assert two["usage"]["cached_tokens"] == one["usage"]["cached_tokens"] > 0
    assert two["usage"]["miss_reason"] == one["usage"]["miss_reason"] == ""


def test_unreachable_host_is_one_line(models, tmp_path):
    """ssh cannot reach the host: rank 0 says so in one line, in bounded time, before it has
    made or changed anything."""
    home = tmp_path / "home"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text("#!/bin/bash\necho 'ssh: connect to host mac2.example port 22: "
                                 "Connection refused' >&2\nexit 255\n")
    (bin_dir / "ssh").chmod(0o755)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]},
                                    {"ssh": "mac2.example", "ips": ["127.0.0.1"]}]))
    env = {**_env(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "localchat", "ask", "-c", "c", "-m",
                          str(models["llama"]), "--hostfile", str(hostfile), "hi"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t < 60
    assert out.returncode == 1
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert lines[-1] == ("localchat: error: rank 1 (127.0.0.1) exited (status 255): ssh: "
                         "connect to host mac2.example port 22: Connection refused"), out.stderr
    assert "Traceback" not in out.stderr
    listed = subprocess.run([sys.executable, "-m", "localchat", "list", "--json"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert json.loads(listed.stdout) == []


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the follower through /proc")
def test_chat_app_follower_lost_leaves_the_screen_then_one_line(models, tmp_path):
    """`localchat chat --hosts …` in a real terminal (a pty): a follower killed mid-reply ends
    the app with the terminal given back (alternate screen left) and one line after it, and the
    streamed part of the reply is stored."""
    from ptyapp import PtyApp

    home = tmp_path / "home"
    # Greedy (the model says so, as a Hub model's generation_config.json can), so the reply is
    # one known run that does not end within the test's half second: sampled, the tiny
    # model's random EOS once ended it before the kill (then nothing was partial).
    model = tmp_path / "llama"
    shutil.copytree(models["llama"], model)
    (model / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert ask(home, model, "probe", "tell me a long story",
               max_tokens=200)["usage"]["completion_tokens"] == 200
    app = PtyApp([sys.executable, "-m", "localchat", "chat", "-c", "c", "-m",
                  str(model), "--hosts", HOSTS], _env(home), rows=40, cols=120)
    try:
        app.wait_for(b"\x1b[?1049h", 60)  # the app took the screen
        app.wait_for(b"ctx ", 60)  # the status bar shows the context once the model is loaded
        app.write(b"tell me a long story")
        for _ in range(15):  # Enter again if it came too early (the text stays in the box)
            app.write(b"\r")
            if app.wait_for(b"starting", 2.0, must=False):  # the status bar: the turn began
                break
        app.wait_for(b"starting", 0)
        time.sleep(0.5)  # the reply is streaming (1,024 tokens at most: a few seconds)
        (follower,) = _followers(home)
        t = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        code = app.wait_exit(TIMEOUT + 20)
        waited = time.monotonic() - t
    finally:
        app.kill()
        for p in _followers(home):
            os.kill(p, signal.SIGKILL)
    assert code == 1
    assert waited < TIMEOUT  # an exit is seen at once; the screen does not hold it up
    lines = app.lines_after_the_screen()  # the alternate screen left: the terminal is back
    assert lines and lines[-1].startswith("localchat: error: rank 1 (127.0.0.1)"), lines
    assert b"Traceback" not in app.screen and b"[ring]" not in app.screen
    assert_partial_reply_kept(home)


def test_disk_budget_covers_every_rank_folder(models, tmp_path):
    """LOCALCHAT_CACHE_LIMIT is one budget for the data folder: a split model's older shard
    caches (every rank's) are cleared to make room, the current conversation's kept."""
    home = tmp_path / "home"
    first = ask(home, models["llama"], "a", "hello one two three", split="tensor")
    used = sum(f.stat().st_size for r in (0, 1) for f in shard_files(home, "tensor", r))
    assert first["reply"] and used > 0
    env = {**_env(home), "LOCALCHAT_CACHE_LIMIT": str(used + 1024)}
    cmd = [sys.executable, "-m", "localchat", "ask", "-c", "b", "-m", str(models["llama"]),
           "--json", "--max-tokens", "12", "--hosts", HOSTS, "--shard", "tensor",
           "hello four five six"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    listed = subprocess.run([sys.executable, "-m", "localchat", "list", "--json"], env=env,
                            capture_output=True, text=True, timeout=60)
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert rows["a"]["messages"] == rows["b"]["messages"] == 2  # messages always stay
    assert rows["a"]["cache_bytes"] == 0 and rows["b"]["cache_bytes"] > 0
    folders = {f.parent.name for r in (0, 1) for f in shard_files(home, "tensor", r)}
    assert len(folders) == 1  # one conversation's shards left: the newer one, on both ranks
    for r in (0, 1):
        assert {f.parent.name for f in shard_files(home, "tensor", r)} == folders
