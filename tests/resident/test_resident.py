"""The resident model process (issue 48): ``ask`` through it prints what ``ask`` in its own
process prints, every cache family resumes exactly through it, concurrent asks share one
model, and its faults (killed mid-turn, a stale socket, another uid, other code, keep-alive
expiry, Ctrl-C, a client gone) lose no message. Each test has its own data folder; no test
leaves a resident behind (checked after each)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from residents import Cli, alive, kill_all, residents_left, wait_for, wait_gone

pytestmark = pytest.mark.skipif(os.name != "posix", reason="resident processes are Unix-only")


@pytest.fixture(autouse=True)
def no_resident_left(tmp_path):
    yield
    left = residents_left(tmp_path)
    for pid in left:  # a resident still there is given its stop first, as a user would
        cli_home = None
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cli_home = next(e.split(b"=", 1)[1].decode() for e in env
                            if e.startswith(b"LOCALCHAT_HOME="))
        except (OSError, StopIteration):
            pass
        if cli_home:
            Cli(__import__("pathlib").Path(cli_home)).run("stop", timeout=60)
    survivors = [p for p in left if not wait_gone(p, 10)]
    kill_all(survivors)
    assert survivors == [], "a resident outlived its test"


@pytest.fixture
def cli(tmp_path):
    c = Cli(tmp_path / "home")
    yield c
    c.run("stop", timeout=60)


def same_output(a: subprocess.CompletedProcess, b: subprocess.CompletedProcess,
                names=()) -> None:
    """Equal stdout, stderr and status, once conversation names are made one."""
    def norm(text: str) -> str:
        for n in names:
            text = text.replace(n, "NAME")
        text = re.sub(r'"ttft_s": [0-9.e-]+', '"ttft_s": T', text)
        return re.sub(r'"(prefill|decode)_tps": [0-9.e-]+', r'"\1_tps": T', text)
    assert (a.returncode, norm(a.stdout), norm(a.stderr)) == \
        (b.returncode, norm(b.stdout), norm(b.stderr))


def test_second_ask_is_answered_by_the_resident_with_the_in_process_reply(cli, tiny_model):
    # The first ask finds no resident: it runs its turn itself, then starts one.
    first = cli.ask("-m", str(tiny_model), "-c", "r", "Hello there", "--max-tokens", "12")
    assert first.returncode == 0, first.stderr
    pid = cli.resident()
    assert "turn in conversation" not in cli.log()
    second = cli.ask("-c", "r", "And then?", "--max-tokens", "12", "--json")
    assert second.returncode == 0, second.stderr
    assert cli.pids() == [pid]
    assert cli.log().count(f"pid {pid}: turn in conversation 'r'") == 1  # the second
    third = cli.ask("-c", "r", "More?", "--max-tokens", "12")
    assert third.returncode == 0 and cli.pids() == [pid]
    assert cli.log().count(f"pid {pid}: turn in conversation 'r'") == 2
    usage = json.loads(second.stdout)["usage"]
    assert usage["cached_tokens"] > 0  # resumed from the cache the first turn stored
    # The same two turns in this process (keep-alive 0): the same replies.
    here = [cli.ask("-m", str(tiny_model), "-c", "h", "Hello there", "--max-tokens", "12",
                    LOCALCHAT_KEEP_ALIVE="0"),
            cli.ask("-c", "h", "And then?", "--max-tokens", "12", "--json",
                    LOCALCHAT_KEEP_ALIVE="0")]
    assert cli.pids() == [pid]
    assert here[0].stdout == first.stdout
    assert json.loads(here[1].stdout)["reply"] == json.loads(second.stdout)["reply"]
    assert json.loads(here[1].stdout)["usage"]["cached_tokens"] == usage["cached_tokens"]
    # Negative control: another prompt gives another reply here, so equality means something.
    other = cli.ask("-c", "h2", "-m", str(tiny_model), "Something else entirely",
                    "--max-tokens", "12", LOCALCHAT_KEEP_ALIVE="0")
    assert other.stdout != first.stdout


SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                     "required": ["a"]})
# (flags, stdin): each row runs in a fresh conversation of each process kind.
ROWS = {
    "plain": ([], None),
    "json": (["--json"], None),
    "system": (["--system", "Be brief [b]not markup[/b]"], None),
    "max tokens": (["--max-tokens", "3", "--json"], None),
    "stdin": (["-"], "한국어 프롬프트 \x1b[31m and escapes\n"),
    "no cache": (["--no-cache", "--json"], None),
    "sampled": (["--temp", "0.8", "--seed", "7"], None),
    "no lookup": (["--speculate", "off"], None),
    "thinking": (["--thinking", "on"], None),  # (no switch here: one notice)
    "regex": (["--regex", "[ab]{3,6}", "--json"], None),
    "format json": (["--format", "json", "--max-tokens", "30", "--json"], None),
    "schema": (["--format", SCHEMA, "--max-tokens", "30", "--json"], None),
    "bad schema": (["--format", '{"type": 5}'], None),
    "bad regex": (["--regex", "(unclosed"], None),
    "over long": (["--context-overflow", "stop", "--max-tokens", "2000"], None),
    "kv bits bad": (["--kv-bits", "4", "--kv-group-size", "128"], None),
}


def test_ask_prints_the_same_bytes_through_the_resident_as_in_process(cli, tiny_model, tmp_path):
    # The same asks, in the same order, in two data folders: one answered by its resident,
    # one in each ask's own process (keep-alive 0). Same folders' histories, so the same
    # conversation names and the same cache files (where a cache splits for sharing depends
    # on which conversations came before): stdout, stderr and status compare byte for byte.
    here = Cli(tmp_path / "here", keep_alive="0")
    clis = (cli, here)
    # One BLAS thread count for both (the controller may choose another in each process
    # under load): other float sums give other K/V bits, so other checksums in the manifest,
    # whose decimal length changes "bytes_written" by a byte now and then.
    for c in clis:
        c.extra["LOCALCHAT_BLAS_THREADS"] = "2"
    for c in clis:
        c.ask("-m", str(tiny_model), "-c", "warm", "hi", "--max-tokens", "2")  # starts it
    pid = cli.resident()
    assert here.pids() == []
    for row, (flags, stdin) in ROWS.items():
        prompt = [] if "-" in flags else ["Tell me something"]
        name = row.replace(" ", "-")
        results = []
        for c in clis:
            c.ask("-m", str(tiny_model), "-c", name, "first turn", "--max-tokens", "5")
            results.append(c.ask("-c", name, *flags, *prompt, input=stdin))
        same_output(*results)
    # --regenerate and --edit-last, and a new conversation (its name said on stderr).
    for flags in (["--regenerate"], ["--edit-last", "Instead this"]):
        same_output(*[c.ask("-c", "plain", *flags, "--json") for c in clis])
    new = [c.ask("-m", str(tiny_model), "A new one") for c in clis]
    same_output(*new, names=[re.search(r"conversation: (\S+)", r.stderr).group(1)
                             for r in new])
    assert cli.pids() == [pid] and here.pids() == []
    assert cli.log().count(f"pid {pid}: turn in conversation") >= len(ROWS) * 2
    assert here.log() == ""
    # Negative control: the comparison sees a one-token difference in the reply.
    a, b = (c.ask("-c", "plain", "--regenerate", "--json", "--max-tokens", n)
            for c, n in zip(clis, ("6", "7")))
    with pytest.raises(AssertionError):
        same_output(a, b)


# Every cache class mlx-lm has: KVCache, MLA (deepseek_v3), RotatingKVCache (gemma3_text),
# ChunkedKVCache (llama4), ArraysCache (mamba2), CacheList (falcon_h1, baichuan_m1).
FAMILIES = ["llama", "deepseek_v3", "gemma3_text", "llama4", "mamba2", "falcon_h1",
            "baichuan_m1"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_cache_family_resumes_exactly_through_the_resident(tmp_path, family):
    from families import build_family

    model = build_family(family, tmp_path / family)
    cli = Cli(tmp_path / "home")
    try:
        turns = ["The first message of a conversation long enough to pass a sliding window",
                 "A second one, resumed from the cache", "A third"]
        replies = []
        for text in turns:
            r = cli.ask("-m", str(model), "-c", "f", text, "--max-tokens", "10", "--json")
            assert r.returncode == 0, r.stderr
            replies.append(json.loads(r.stdout))
        assert all(r["usage"]["cached_tokens"] > 0 for r in replies[1:])
        full = cli.ask("-c", "f", "--regenerate", "--no-cache", "--max-tokens", "10", "--json")
        full = json.loads(full.stdout)
        assert full["usage"]["cached_tokens"] == 0
        assert full["reply"] == replies[-1]["reply"]
        assert len(cli.pids()) == 1
    finally:
        cli.run("stop", timeout=60)


def test_eight_concurrent_asks_share_one_model_and_each_gets_its_lone_reply(cli, tiny_model):
    prompts = [f"Question number {i}: {'why ' * i}" for i in range(8)]
    cli.ask("-m", str(tiny_model), "-c", "warm", "hi", "--max-tokens", "2")
    pid = cli.resident()
    procs = [cli.popen("ask", "-m", str(tiny_model), "-c", f"c{i}", p, "--max-tokens", "16")
             for i, p in enumerate(prompts)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert cli.pids() == [pid]  # one model in memory
    lone = [cli.ask("-m", str(tiny_model), "-c", f"lone{i}", p, "--max-tokens", "16",
                    LOCALCHAT_KEEP_ALIVE="0").stdout for i, p in enumerate(prompts)]
    assert [o[0].decode() for o in outs] == lone
    assert len(set(lone)) > 1  # (the prompts lead to different replies)


def test_ps_lists_the_resident_and_stop_ends_it(cli, tiny_model):
    assert "no resident model process" in cli.run("ps").stderr
    cli.ask("-m", str(tiny_model), "-c", "p", "hi", "--max-tokens", "3")
    pid = cli.resident()
    [row] = [json.loads(line) for line in cli.run("ps", "--json").stdout.splitlines()]
    assert row["pid"] == pid and row["model"] == str(tiny_model.resolve())
    assert row["turns"] == 0 and row["memory"] > 10 * 2**20 and row["ready"] is True
    assert 0 < row["keep_alive_left_s"] <= 60
    table = cli.run("ps").stdout
    assert str(pid) in table and "MEMORY" in table
    assert "no resident model process for other" in cli.run("stop", "other").stderr
    assert cli.pids() == [pid]  # (stop MODEL stops only that model's)
    done = cli.run("stop")
    assert f"pid {pid}" in done.stderr
    assert not alive(pid) and cli.pids() == []
    assert list((cli.home / "run").glob("*.sock")) == []


def test_keep_alive_expires_and_no_process_is_left(tmp_path, tiny_model):
    cli = Cli(tmp_path / "home", keep_alive="2s")
    cli.ask("-m", str(tiny_model), "-c", "k", "hi", "--max-tokens", "3")
    pid = cli.resident()
    assert wait_gone(pid, 2 + 5 + 3)  # within its keep-alive and 5 s (and a slow start)
    assert list((cli.home / "run").glob("*.sock")) == []
    assert list((cli.home / "run").glob("*.json")) == []
    # --keep-alive 0: no resident at all, the turn runs here.
    r = cli.ask("-c", "k", "again", "--max-tokens", "3", "--keep-alive", "0")
    assert r.returncode == 0 and cli.pids() == []


def _first_bytes(proc: subprocess.Popen, n: int = 1) -> bytes:
    return proc.stdout.read(n)


@pytest.mark.parametrize("when", ["before the reply", "during the reply"])
def test_resident_killed_mid_turn_keeps_the_message(cli, tiny_model, when):
    cli.ask("-m", str(tiny_model), "-c", "kill", "hi", "--max-tokens", "3")
    pid = cli.resident()
    long_prompt = " ".join(["word"] * 300)
    for _ in range(5):
        proc = cli.popen("ask", "-c", "kill", long_prompt, "--max-tokens", "600")
        if when == "before the reply":
            # The message is in the database: stop the resident there (prefill is under way
            # or about to be), then kill it.
            wait_for(lambda: any(m[0] == "user" and m[1] == long_prompt
                                 for m in cli.messages("kill")))
            os.kill(pid, signal.SIGSTOP)
            break
        assert _first_bytes(proc)
        os.kill(pid, signal.SIGSTOP)
        if cli.messages("kill")[-1][0] == "user":
            break  # stopped during the reply
        # (the tiny model wrote its whole reply before the client read its first byte: again)
        os.kill(pid, signal.SIGCONT)
        assert proc.wait(timeout=60) == 0
    else:
        pytest.fail("each reply ended before it could be stopped")
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err.decode()
    lines = err.decode().strip().splitlines()
    assert lines[-1].startswith("localchat: error: the resident model process "
                                f"(pid {pid}) ended during the turn; your message is saved")
    assert "Traceback" not in err.decode()
    assert [m[:2] for m in cli.messages("kill")][-1] == ("user", long_prompt)
    # The next ask starts a new resident; --regenerate answers the kept message.
    again = cli.ask("-c", "kill", "--regenerate", "--max-tokens", "5")
    # (its text may be blank: how many turns the loop above took changes the conversation,
    # and a random model may answer this one with spaces)
    assert again.returncode == 0 and again.stdout, again.stderr
    assert cli.resident() != pid
    assert cli.messages("kill")[-1][0] == "assistant"


def test_a_stale_socket_is_removed_and_a_new_resident_answers(cli, tiny_model):
    cli.ask("-m", str(tiny_model), "-c", "s", "hi", "--max-tokens", "3")
    pid = cli.resident()
    [sock] = list((cli.home / "run").glob("*.sock"))
    os.kill(pid, signal.SIGKILL)  # its socket file stays, nobody listening
    assert wait_gone(pid) and sock.exists()
    r = cli.ask("-c", "s", "again", "--max-tokens", "3")  # (runs here, starts a new one)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert "resident" not in r.stderr  # (nothing to say)
    new = cli.resident()
    assert new != pid
    assert cli.ask("-c", "s", "and again", "--max-tokens", "3").returncode == 0
    assert f"pid {new}: turn in conversation 's'" in cli.log()


def test_a_resident_of_other_code_is_replaced_never_used(cli, tiny_model):
    from localchat.resident import place as places

    env = cli.env()
    key = subprocess.run(
        [sys.executable, "-c", "from localchat.resident.place import place_for; import sys; "
         f"print(place_for({str(tiny_model)!r}).key)"],
        env=env, capture_output=True, text=True, check=True).stdout.strip()
    log = places.Place(cli.home.resolve(), str(tiny_model.resolve()), key).log
    log.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log, "ab")
    old = subprocess.Popen(
        [sys.executable, "-m", "localchat.resident.daemon", "--model",
         str(tiny_model.resolve()), "--key", key, "--keep-alive", "60", "--digest", "0" * 16,
         "--foreground"], env=env, stdout=subprocess.DEVNULL,
        stderr=log_file,  # (where a started resident's starter points it)
        start_new_session=True)
    try:
        place = places.Place(cli.home.resolve(), str(tiny_model.resolve()), key)
        wait_for(lambda: (cli.home / "run" / place.sock_name).exists())
        r = cli.ask("-m", str(tiny_model), "-c", "o", "hi", "--max-tokens", "3")
        assert r.returncode == 0, r.stderr
        assert old.wait(timeout=30) == 0  # it retired
        new = cli.resident()  # (the ask ran its turn itself, then started this one)
        assert new != old.pid
        assert cli.ask("-c", "o", "again", "--max-tokens", "3").returncode == 0
        log = cli.log()
        assert f"pid {old.pid}: retiring: a client of other localchat code" in log
        assert f"pid {old.pid}: turn in conversation" not in log
        assert f"pid {new}: turn in conversation 'o'" in log
    finally:
        log_file.close()
        if old.poll() is None:
            old.kill()
            old.wait()


def test_ctrl_c_through_the_client_stops_the_turn_and_keeps_the_partial_reply(cli, tiny_model):
    cli.ask("-m", str(tiny_model), "-c", "i", "hi", "--max-tokens", "3")
    pid = cli.resident()
    proc = cli.popen("ask", "-c", "i", "Tell me a long story", "--max-tokens", "1000")
    assert _first_bytes(proc)
    os.kill(pid, signal.SIGSTOP)  # (so the reply cannot end before the Ctrl-C)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    os.kill(pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.decode().strip().splitlines()[-1] == \
        "localchat: stopped; the partial reply is saved"
    role, content, partial = cli.messages("i")[-1]
    assert role == "assistant" and partial == 1 and content
    assert cli.pids() == [pid]  # the resident goes on
    assert cli.ask("-c", "i", "next", "--max-tokens", "3").returncode == 0


def test_a_client_that_goes_away_stops_its_turn_and_loses_nothing(cli, tiny_model):
    cli.ask("-m", str(tiny_model), "-c", "g", "hi", "--max-tokens", "3")
    pid = cli.resident()
    proc = cli.popen("ask", "-c", "g", "Tell me a long story", "--max-tokens", "1000")
    assert _first_bytes(proc)
    os.kill(pid, signal.SIGSTOP)  # (so the reply cannot end before the client is gone)
    proc.kill()
    proc.wait()
    os.kill(pid, signal.SIGCONT)
    wait_for(lambda: cli.messages("g")[-1][0] == "assistant", timeout=30)
    role, content, partial = cli.messages("g")[-1]
    assert partial == 1 and content
    assert cli.pids() == [pid]
    nxt = cli.ask("-c", "g", "next", "--max-tokens", "3", "--json")
    assert json.loads(nxt.stdout)["usage"]["cached_tokens"] > 0


def test_a_resident_that_cannot_start_costs_one_notice_and_the_turn_runs_here(
        tmp_path, tiny_model):
    cli = Cli(tmp_path / "home")
    (cli.home / "run").write_text("not a folder")  # where its socket would go
    r = cli.ask("-m", str(tiny_model), "-c", "n", "hi", "--max-tokens", "3")
    assert r.returncode == 0 and r.stdout.strip()
    notes = [line for line in r.stderr.splitlines() if "resident" in line]
    assert len(notes) == 1 and notes[0].endswith("running the model in this process"), r.stderr
    assert cli.pids() == []


def test_a_resident_that_failed_to_start_is_said_once_at_the_next_ask(cli, tiny_model):
    cli.ask("-m", str(tiny_model), "-c", "f", "hi", "--max-tokens", "3")
    pid = cli.resident()
    [info] = list((cli.home / "run").glob("*.json"))
    key = info.stem
    # A second resident for the same place cannot listen (the first one does): it says why
    # in the log and leaves the reason for the next client.
    second = subprocess.run(
        [sys.executable, "-m", "localchat.resident.daemon", "--model", str(tiny_model.resolve()),
         "--key", key, "--keep-alive", "60", "--foreground"], env=cli.env(),
        capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and "not started" in second.stderr
    assert (cli.home / "run" / f"{key}.failed").exists()
    assert cli.run("stop").returncode == 0 and wait_gone(pid)
    r = cli.ask("-c", "f", "again", "--max-tokens", "3")
    assert r.returncode == 0 and r.stdout.strip()
    notes = [line for line in r.stderr.splitlines() if "resident" in line]
    assert notes == [f"localchat: the resident model process could not listen (Address "
                     f"already in use) (see {cli.home.resolve() / 'logs' / f'resident-{key}.log'}"
                     "); running the model in this process"], r.stderr
    assert not (cli.home / "run" / f"{key}.failed").exists()  # said once
    assert cli.resident() != pid  # and started again
    r = cli.ask("-c", "f", "once more", "--max-tokens", "3")
    assert r.returncode == 0 and "resident" not in r.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to connect as another user")
def test_a_client_of_another_uid_is_refused(tmp_path, tiny_model):
    import tempfile

    # A data folder other users can reach (the tests' own tmp_path is not).
    home = tempfile.mkdtemp(prefix="lc-uid-")
    cli = Cli(__import__("pathlib").Path(home) / "home")
    try:
        os.chmod(home, 0o711)
        cli.ask("-m", str(tiny_model), "-c", "u", "hi", "--max-tokens", "3")
        pid = cli.resident()
        [sock] = list((cli.home / "run").glob("*.sock"))
        for folder in (cli.home, cli.home / "run"):
            os.chmod(folder, 0o711)
        os.chmod(sock, 0o666)  # the file's mode no longer keeps others out: the uid check must
        # Closed unanswered: an empty read, or a reset where the refusal beat the request.
        probe = ("import socket,sys\ns=socket.socket(socket.AF_UNIX); s.settimeout(10)\n"
                 "s.connect(sys.argv[1])\ntry:\n"
                 "    s.sendall(b'{\"op\": \"status\"}\\n'); got = s.recv(65536)\n"
                 "except (ConnectionResetError, BrokenPipeError):\n    got = b''\n"
                 "print(repr(got))")
        other = subprocess.run(["setpriv", "--reuid", "nobody", "--regid", "nogroup",
                                "--clear-groups", sys.executable, "-c", probe, str(sock)],
                               capture_output=True, text=True, timeout=30)
        assert other.returncode == 0, other.stderr
        assert other.stdout.strip() == "b''"  # closed unanswered
        assert re.search(rf"pid {pid}: refused a connection from uid \d+", cli.log())
        # Negative control: the same probe as the owner gets the status.
        mine = subprocess.run([sys.executable, "-c", probe, str(sock)], capture_output=True,
                              text=True, timeout=30)
        assert '"status"' in mine.stdout
    finally:
        cli.run("stop", timeout=60)
        shutil.rmtree(home, ignore_errors=True)


def test_strangers_on_the_socket_get_one_error_line_and_it_goes_on(cli, tiny_model):
    cli.ask("-m", str(tiny_model), "-c", "x", "hi", "--max-tokens", "3")
    pid = cli.resident()
    [sock] = list((cli.home / "run").glob("*.sock"))
    for junk in (b"\xff\xfe garbage\n", b"[1, 2]\n", b'{"op": "ask"}\n', b'{"op": 5}\n',
                 b'{"op": "ask", "ask": {"model": "m", "prompt": "x", "max_tokens": true}}\n',
                 b'{"op": "status", "extra": 1}\n', b"{" * 100000 + b"\n", b"\n"):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(15)
        s.connect(str(sock))
        s.sendall(junk)
        answer = s.makefile("rb").readline()
        s.close()
        obj = json.loads(answer)
        assert obj["t"] == "error" and obj["code"] == 2 and "\n" not in obj["message"]
    assert cli.pids() == [pid]
    assert cli.ask("-c", "x", "still there?", "--max-tokens", "3").returncode == 0
    assert "Traceback" not in cli.log()


def test_ask_through_the_resident_imports_no_mlx_numpy_or_tokenizer(cli, tiny_model):
    cli.ask("-m", str(tiny_model), "-c", "m", "hi", "--max-tokens", "3")
    cli.resident()  # (ready: an ask while it still starts runs in its own process)
    probe = ("import sys, runpy; sys.argv = ['localchat'] + sys.argv[1:]\n"
             "from localchat.cli.main import main\n"
             "code = main(sys.argv[1:])\n"
             "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
             "('mlx', 'numpy', 'tokenizers', 'transformers', 'jinja2', 'mlx_lm', "
             "'llguidance'))\n"
             "print('HEAVY', heavy, code)\n")
    r = subprocess.run([sys.executable, "-c", probe, "ask", "-c", "m", "hi again",
                        "--max-tokens", "3", "--format", "json"], env=cli.env(),
                       capture_output=True, text=True, timeout=120)
    assert "HEAVY [] 0" in r.stdout, (r.stdout, r.stderr)
    # Negative control: the same probe in-process does import them.
    r = subprocess.run([sys.executable, "-c", probe, "ask", "-c", "m", "hi again",
                        "--max-tokens", "3"], env=cli.env(LOCALCHAT_KEEP_ALIVE="0"),
                       capture_output=True, text=True, timeout=120)
    assert "'mlx.core'" in r.stdout and "'numpy'" in r.stdout, (r.stdout, r.stderr)
