"""No BLAS is trusted before a child process has run it (localchat/cpu/probe.py).

Real faults, on any CPU: copies of the installed OpenBLAS whose ``cblas_sgemm`` starts with an
undefined instruction (SIGILL when called), returns at once (wrong numbers) or jumps to itself
(a hang), found through the ELF symbol table (``elfpatch.py``). The probe refuses each; ``ask``
and the app answer with the next candidate and one notice names the refused library; the
verdict file is checked field by field, per library identity and CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import sys
import time
from pathlib import Path

import pytest

from localchat.cpu import backend, probe

pytestmark = [pytest.mark.cpu_only,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]


def _real() -> Path:
    wheels = [c for c in backend.candidates() if "cmeel.prefix" in c]
    if not wheels:
        pytest.skip("no cmeel-openblas wheel installed")
    return Path(wheels[0])


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> dict[str, Path]:
    from elfpatch import patched_copy

    folder = tmp_path_factory.mktemp("faulty")
    return {fault: patched_copy(_real(), folder / f"libopenblas-{fault}.so.0", fault=fault)
            for fault in ("trap", "return", "loop")}


def test_the_probe_refuses_a_crash_wrong_numbers_and_a_hang(faulty):
    crash = probe.probe(str(faulty["trap"]))
    assert not crash.ok and crash.reason == "crashed (SIGILL) in a test run"
    wrong = probe.probe(str(faulty["return"]))
    assert not wrong.ok and wrong.reason.startswith("wrong results (sgemm relative error")
    t = time.monotonic()
    hung = probe.probe(str(faulty["loop"]), timeout=3)
    assert not hung.ok and hung.reason == "no answer in 3 s" and time.monotonic() - t < 20
    # Negative control: the library they were made from passes, with its build and kernels.
    good = probe.probe(str(_real()))
    assert good.ok and good.reason == "" and good.gflops > 0
    assert good.config.startswith("OpenBLAS") and good.core


def _ask(tiny_model, home: Path, env: dict) -> tuple[int, str, dict | None]:
    import subprocess

    full = {**os.environ, "LOCALCHAT_HOME": str(home), **env}
    full.pop("LOCALCHAT_BLAS", None) if "LOCALCHAT_BLAS" not in env else None
    out = subprocess.run([sys.executable, "-m", "localchat", "ask", "-m", str(tiny_model),
                          "--max-tokens", "5", "--json", "Hello"], env=full,
                         capture_output=True, text=True, timeout=180)
    try:
        reply = json.loads(out.stdout)
    except ValueError:
        reply = None
    return out.returncode, out.stderr, reply


@pytest.mark.parametrize("given", ["LOCALCHAT_BLAS", "search path"])
def test_ask_answers_with_the_next_candidate_and_one_notice(tiny_model, tmp_path, faulty,
                                                            given):
    """The crashing copy named by LOCALCHAT_BLAS, or found first on the search path (a wheel
    folder ahead of the real one): ``ask`` answers, with one line naming it, twice (the second
    start reads the verdict instead of running the library again)."""
    trap = faulty["trap"]
    if given == "LOCALCHAT_BLAS":
        env = {"LOCALCHAT_BLAS": str(trap)}
    else:
        site = tmp_path / "site"
        (site / "cmeel.prefix" / "lib").mkdir(parents=True)
        shutil.copy(trap, site / "cmeel.prefix" / "lib" / "libopenblas.so.0")
        trap = site / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        env = {"PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    home = tmp_path / "home"
    for _start in range(2):
        code, err, reply = _ask(tiny_model, home, env)
        assert code == 0, err
        assert reply["usage"]["completion_tokens"] >= 1
        notes = [ln for ln in err.splitlines() if "refused" in ln]
        assert len(notes) == 1, err
        assert str(trap) in notes[0] and "crashed (SIGILL) in a test run" in notes[0]
        assert "using " in notes[0] and "slow CPU path" not in err and "Traceback" not in err
        if given == "LOCALCHAT_BLAS":
            assert notes[0].startswith(f"localchat: LOCALCHAT_BLAS={trap} refused")
    stored = json.loads((home / "cpu-runtime" / "blas-verdicts.json").read_text())
    verdicts = {e["identity"]["path"]: e["verdict"] for e in stored["entries"].values()}
    assert verdicts[os.path.realpath(trap)]["ok"] is False
    assert verdicts[os.path.realpath(_real())]["ok"] is True


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="runs the app in a pseudo-terminal")
def test_the_app_answers_with_the_next_candidate(tiny_model, tmp_path, faulty):
    from ptyapp import PtyApp

    home = tmp_path / "home"
    app = PtyApp([sys.executable, "-m", "localchat", "chat", "-c", "c", "-m", str(tiny_model)],
                 {"LOCALCHAT_HOME": str(home), "LOCALCHAT_BLAS": str(faulty["trap"]),
                  "LOCALCHAT_DRAFT_PREFILL": "0"}, rows=40, cols=160)
    try:
        app.wait_for(b"ctx ", 90)  # the model is loaded
        app.wait_for(b"refused", 10)  # the notice
        app.write(b"Hello there")
        replies = []
        for _ in range(30):
            app.write(b"\r")
            time.sleep(1.0)
            with sqlite3.connect(home / "localchat.db") as db:
                replies = db.execute("SELECT content FROM messages WHERE role = 'assistant'"
                                     ).fetchall()
            if replies:
                break
        assert replies and replies[0][0], bytes(app.screen[-2000:])
        assert app.status is None  # still running: the faulty library never ran in it
    finally:
        app.kill()


# -- the verdict file ----------------------------------------------------------------------


def _entries(home: Path) -> dict:
    return json.loads((home / "cpu-runtime" / "blas-verdicts.json").read_text())


def _write(home: Path, data) -> None:
    (home / "cpu-runtime" / "blas-verdicts.json").write_text(json.dumps(data))


def test_a_verdict_is_kept_per_library_and_cpu(home, faulty, monkeypatch):
    trap = str(faulty["trap"])
    first = probe.check(trap)
    assert not first.ok and not first.cached
    again = probe.check(trap)
    assert again.cached and again.reason == first.reason
    # Another CPU: its kernels may differ, so the library runs again.
    monkeypatch.setattr(probe, "cpu_identity", lambda: "another-cpu")
    assert not probe.check(trap).cached
    assert probe.check(trap).cached
    assert len(_entries(home)["entries"]) == 2


def _mutations(entry: dict):
    """(what, entry') pairs: every field of an entry changed, checksum left stale."""
    for key in entry["identity"]:
        value = entry["identity"][key]
        yield f"identity.{key}", {**entry, "identity": {**entry["identity"],
                                                        key: _other(value)}}
    for key in entry["verdict"]:
        value = entry["verdict"][key]
        for wrong in (_other(value), None, str(value), [value]):
            if type(wrong) is type(value) and wrong == value:
                continue  # not a change
            yield f"verdict.{key}={wrong!r}", {**entry, "verdict": {**entry["verdict"],
                                                                  key: wrong}}
    yield "verdict claims ok", {**entry, "verdict": {**entry["verdict"], "ok": True,
                                                     "reason": ""}}
    yield "check", {**entry, "check": "0" * 64}
    yield "no check", {k: v for k, v in entry.items() if k != "check"}
    yield "extra key", {**entry, "more": 1}
    yield "not an object", [entry]


def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return str(value) + "x"


def test_every_field_of_a_damaged_verdict_means_running_the_library_again(home, faulty):
    """The crashing library's entry, each field changed (a damaged entry that says "ok" among
    them): never used — the library is run again in a child and refused again."""
    trap = str(faulty["trap"])
    probe.check(trap)
    clean = _entries(home)
    ((key, entry),) = clean["entries"].items()
    cases = list(_mutations(entry))
    cases += [("format", {**clean, "format": 2}), ("entries", {**clean, "entries": []}),
              ("not json", None)]
    for what, damaged in cases:
        if what in ("format", "entries", "not json"):
            if damaged is None:
                (home / "cpu-runtime" / "blas-verdicts.json").write_bytes(b"\xff{")
            else:
                _write(home, damaged)
        else:
            _write(home, {**clean, "entries": {key: damaged}})
        got = probe.check(trap)
        assert not got.ok and not got.cached, what
        assert got.reason == "crashed (SIGILL) in a test run", what
        assert probe.check(trap).cached, what  # written back whole
    # Negative control: the clean file is used as it is.
    _write(home, clean)
    assert probe.check(trap).cached


def test_a_library_replaced_in_place_with_the_same_size_and_mtime_runs_again(home, tmp_path,
                                                                                faulty):
    lib = tmp_path / "libopenblas.so.0"
    shutil.copy(_real(), lib)
    assert probe.check(str(lib)).ok
    st = lib.stat()
    before = probe.library_identity(str(lib))
    with open(lib, "r+b") as f:  # the same file (inode), other bytes, same size
        f.write(faulty["trap"].read_bytes())
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = probe.library_identity(str(lib))
    assert {k: v for k, v in after.items() if k != "xxh3"} == \
        {k: v for k, v in before.items() if k != "xxh3"}  # only the digest tells them apart
    got = probe.check(str(lib))
    assert not got.cached and not got.ok and "SIGILL" in got.reason


def test_a_refused_library_is_never_loaded_in_process(tmp_path, faulty):
    """``prepare`` in a fresh process whose only candidate computes wrong numbers: the
    reference BLAS answers right, and the notice names the library and why."""
    import subprocess

    code = ("from localchat.cpu import backend; backend.candidates = lambda: []; "
            "s = backend.prepare(); "
            "import mlx.core as mx; a = mx.ones((64, 64)); print((a @ a).sum().item()); "
            "print(s.path); print(backend.blas_notice())")
    env = {**os.environ, "LOCALCHAT_HOME": str(tmp_path / "home"),
           "LOCALCHAT_BLAS": str(faulty["return"])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    total, path, notice = out.stdout.strip().splitlines()
    assert float(total) == 64 * 64 * 64 and path == "None"
    assert f"LOCALCHAT_BLAS={faulty['return']} refused: wrong results" in notice
    assert "slow CPU path" in notice
