import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Test modules whose helpers other folders' tests import (the app's Pilot helpers in test_tui,
# the MCP fixtures in test_tools, the request helpers in test_server_requests): importable
# from any folder, also when a test file runs alone.
for _folder in ("tui", "tools", "server"):
    sys.path.insert(1, str(Path(__file__).parent / _folder))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Nothing a test does touches the user's own data folder: a scratch one for the whole run
# (the ``home`` fixture gives each test its own on top).
_HOME = tempfile.mkdtemp(prefix="localchat-tests-")
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)
os.environ["LOCALCHAT_HOME"] = _HOME
# No resident model process unless a test starts one on purpose (``tests/resident``): each
# ``ask`` loads its model in its own process, as the tests of its behaviour expect.
os.environ["LOCALCHAT_KEEP_ALIVE"] = "0"
# OpenBLAS's own thread count, not one chosen while running (``cpu/threads.py``): timings and
# batched rounding stay as they were; the controller's own tests turn it on.
os.environ["LOCALCHAT_BLAS_THREADS"] = "off"

from localchat.cpu import backend  # noqa: E402

backend.prepare()  # as the app does, before anything imports mlx.core

from localchat import paths  # noqa: E402

paths.keep_private()  # as every entry point does: what the tests create is owner-only

from tiny import build_tiny_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cpu_only`` tests check the Linux-CPU speed-ups; where this run takes
    the Metal/CUDA branches (a GPU device, or ``LOCALCHAT_CPU_PATH=off`` on a CPU) they are
    skipped with the reason, and the rest of the suite runs those branches."""
    if backend.cpu_path():
        return
    skip = pytest.mark.skip(reason="tests the Linux-CPU path (fast BLAS, float32 weights, "
                            "localchat's attention); this run takes MLX's own kernels")
    for item in items:
        if "cpu_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def engine(tiny_model):
    from localchat.model.engine import Engine

    return Engine.load(str(tiny_model))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LOCALCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def store(home):
    from localchat import paths
    from localchat.store.database import Store

    s = Store.open(paths.database_path())
    yield s
    s.close()


@pytest.fixture
def session(store, engine, home):
    from localchat import paths
    from localchat.session.session import Session

    return Session(store, engine, paths.kv_root(), paths.locks_dir())


@pytest.fixture
def quantized_model(tiny_model, tmp_path):
    """The tiny model with 4-bit weights, as mlx-lm saves quantized models."""
    import json
    import shutil

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    out = tmp_path / "tiny-q4"
    shutil.copytree(tiny_model, out)
    model, config = load_model(out)
    nn.quantize(model, group_size=32, bits=4)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config["quantization"] = {"group_size": 32, "bits": 4}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def family_engine(tmp_path_factory):
    """``family_engine(name)``: the loaded tiny model of that family (``families.py``), built
    once per test module."""
    from families import build_family

    from localchat.model.engine import Engine

    made: dict[str, Engine] = {}

    def get(name: str) -> Engine:
        if name not in made:
            folder = build_family(name, tmp_path_factory.mktemp(name) / name)
            made[name] = Engine.load(str(folder))
        return made[name]
    return get


# -- ``localchat serve`` in a subprocess (tests/serving.py) ----------------------------------


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, Path]:
    """A tiny model of each cache kind ``localchat serve`` is tested on (``serving.KINDS``)."""
    from families import build_family
    from serving import KINDS

    root = tmp_path_factory.mktemp("serve-models")
    return {k: build_family(k, root / k) for k in KINDS}


@pytest.fixture
def server(tmp_path, kinds):
    """``server(kind, *args, model=…, scripted=…)`` starts ``localchat serve``; every server
    started is stopped at the end, and none may have printed a traceback."""
    from serving import Server

    started = []

    def start(kind: str = "llama", *args: str, model: Path | None = None, **kw) -> "Server":
        s = Server(tmp_path / "home", model or kinds[kind], *args, **kw).start()
        started.append(s)
        return s

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.stop()
        assert "Traceback" not in s.err, s.err




@pytest.fixture
def make_app(home, engine):
    """``make(replies, delay, **app_args)`` → (the chat app, its scripted engine): the tiny
    real model, with replies taken from a queue (``fakes.ScriptedEngine``)."""
    from fakes import ScriptedEngine

    from localchat.tui.app import LocalchatApp

    def make(replies=(), delay=0.0, **kw):
        scripted = ScriptedEngine(engine, list(replies), delay)
        return LocalchatApp(load_engine=lambda name, progress: scripted, **kw), scripted
    return make


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """``small(family)``: a tiny model of that family with a 512-token context (the window
    tests: ``test_window.py``, ``test_summary.py``)."""
    import json

    from families import build_family
    from windowed import CONTEXT

    from localchat.model.engine import Engine

    made: dict[str, Engine] = {}

    def get(family: str) -> Engine:
        if family not in made:
            folder = build_family(family, tmp_path_factory.mktemp(family) / family)
            config = json.loads((folder / "config.json").read_text())
            config["max_position_embeddings"] = CONTEXT
            (folder / "config.json").write_text(json.dumps(config))
            made[family] = Engine.load(str(folder))
            assert made[family].info().context_length == CONTEXT
        return made[family]
    return get
