"""The Linux CPU fast path: OpenBLAS loaded before MLX, quantized weights run as float32."""

import json
import os
import shutil
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from localchat.cpu import backend, runtime
from localchat.model.engine import Engine


@pytest.mark.cpu_only
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_openblas_is_loaded_on_linux():
    assert backend.blas_in_use() and "openblas" in backend.blas_in_use()


@pytest.mark.cpu_only
def test_cpu_runs_quantized_weights_dequantized_and_caches_them(home, quantized_model):
    from mlx_lm.utils import load_model

    reference, _ = load_model(quantized_model)  # still quantized
    x = mx.array([[5, 17, 42, 99, 7]])
    expected = reference(x)

    first = Engine.load(str(quantized_model))
    layers = [m for _, m in first.model.named_modules()]
    assert not any(isinstance(m, nn.QuantizedLinear) for m in layers)
    assert any(isinstance(m, nn.Linear) and m.weight.dtype == mx.float32 for m in layers)
    cached = list((home / "cpu-weights").glob("*.safetensors"))
    assert len(cached) == 1
    # The second load reads the cache on a thread while mlx-lm imports (backend.prefetch).
    from localchat.cpu import backend
    from localchat.cpu.derived import load_checked

    source = first.info().model_digest
    fetched = backend.prefetch(cached[0], source)
    assert fetched is not None
    got, direct = fetched.result(), load_checked(cached[0], source)
    assert got.keys() == direct.keys() and all(mx.array_equal(got[k], direct[k]) for k in got)
    assert backend.prefetch(cached[0].with_name("none.safetensors"), source) is None
    second = Engine.load(str(quantized_model))  # from the weights cache this time
    out1, out2 = first.model(x), second.model(x)
    assert mx.array_equal(out1, out2)
    assert mx.allclose(out1, expected.astype(mx.float32), atol=1e-3, rtol=1e-3)


def _without_system_gfortran(cmd: list[str]) -> list[str]:
    """``cmd`` run where the system's libgfortran.so.5 is hidden, as on a fresh machine.

    Hidden with a bind mount in a private mount namespace (root and ``unshare`` needed); on
    a machine that has no libgfortran.so.5 the command runs as it is.
    """
    import subprocess

    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    libs = sorted({line.rsplit("=>", 1)[1].strip() for line in listing.splitlines()
                   if "libgfortran.so.5 " in line})
    if not libs:
        return cmd
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("cannot hide the system's libgfortran.so.5 (needs root and unshare)")
    mounts = " && ".join(f"mount --bind /dev/null {os.path.realpath(p)}" for p in libs)
    return ["unshare", "-m", "sh", "-c", f'{mounts} && exec "$@"', "sh", *cmd]


@pytest.mark.cpu_only
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_fresh_machine_without_libgfortran_still_gets_openblas(tmp_path):
    import subprocess

    code = ("import ctypes.util; from localchat.cpu import backend; s = backend.prepare(); "
            "import mlx.core as mx; a = mx.arange(16.0).reshape(4, 4); "
            "print(s.path, ctypes.util.find_library('gfortran'), (a @ a).sum().item())")
    env = {**os.environ, "LOCALCHAT_HOME": str(tmp_path / "home")}
    env.pop("LOCALCHAT_BLAS", None)
    out = subprocess.run(_without_system_gfortran([sys.executable, "-c", code]), env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path, gfortran, total = out.stdout.split()
    assert "openblas" in path and gfortran == "None"
    assert float(total) == float((mx.arange(16.0).reshape(4, 4) @ mx.arange(16.0).reshape(4, 4))
                                 .sum().item())
    copies = list((tmp_path / "home" / "cpu-runtime").glob("libgfortran.so.5-*"))
    assert len(copies) == 1  # made from a wheel's bundled copy, kept for the next start


def test_soname_patch_changes_only_the_soname():
    libs = runtime.bundled_gfortran()
    if not libs:
        pytest.skip("no wheel here bundles libgfortran")
    original = libs[0][0].read_bytes()
    patched = runtime.soname_patched(original, b"libgfortran.so.5")
    assert len(patched) == len(original)
    assert sum(a != b for a, b in zip(original, patched)) <= 8  # one DT_SONAME value
    with pytest.raises(ValueError):
        runtime.soname_patched(original, b"libnothing.so.9")


@pytest.mark.cpu_only
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_no_fast_blas_says_so_once_and_still_answers(tiny_model, tmp_path):
    import subprocess

    missing = tmp_path / "missing" / "libopenblas.so"
    env = {**os.environ, "LOCALCHAT_HOME": str(tmp_path / "home"), "LOCALCHAT_BLAS": str(missing)}
    ask = ["ask", "-m", str(tiny_model), "--max-tokens", "5", "--json", "Hello"]
    # The named library is missing: the next candidate answers, one line says so.
    out = subprocess.run([sys.executable, "-m", "localchat", *ask], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "refused" in ln]
    assert len(lines) == 1 and f"LOCALCHAT_BLAS={missing} refused" in lines[0]
    assert "using " in lines[0] and "slow CPU path" not in out.stderr
    # And no other candidate either (none on this machine's paths): MLX's reference BLAS.
    only = ("import sys; from localchat.cpu import backend; backend.candidates = lambda: []; "
            "from localchat.cli.main import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", only, *ask], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "slow CPU path" in ln]
    assert len(lines) == 1 and "libopenblas.so" in lines[0] and "LOCALCHAT_BLAS=" in lines[0]
    assert "Traceback" not in out.stderr
    assert json.loads(out.stdout)["usage"]["completion_tokens"] >= 1
    # Disabled on purpose: no notice.
    env["LOCALCHAT_BLAS"] = "off"
    out = subprocess.run([sys.executable, "-m", "localchat", "inspect", "-m", str(tiny_model)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "slow CPU path" not in out.stderr
    assert "reference BLAS" in out.stdout and "GFLOP/s" in out.stdout


def _flip(path, at: int, n: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.cpu_only
@pytest.mark.parametrize("damage", ["flipped", "truncated", "no check file"])
def test_damaged_cpu_weights_are_rebuilt_with_a_notice(home, quantized_model, damage):
    x = mx.array([[5, 17, 42, 99, 7]])
    fresh = Engine.load(str(quantized_model))
    assert fresh.notices == []
    expected = fresh.model(x)
    (cached,) = (home / "cpu-weights").glob("*.safetensors")
    if damage == "flipped":
        _flip(cached, cached.stat().st_size // 2)
    elif damage == "truncated":
        os.truncate(cached, cached.stat().st_size - 4096)
    else:
        cached.with_name(cached.name + ".check.json").unlink()
    if damage == "flipped":  # negative control: the damage changes weights the model uses
        from mlx.utils import tree_flatten

        used = dict(tree_flatten(fresh.model.parameters()))
        blind = mx.load(str(cached))
        assert any(not mx.array_equal(blind[k], used[k + ".weight"]) for k in blind)
    again = Engine.load(str(quantized_model))
    assert len(again.notices) == 1 and again.notices[0].startswith("CPU weights rebuilt:")
    assert mx.array_equal(again.model(x), expected)
    third = Engine.load(str(quantized_model))  # the rebuilt file passes its check
    assert third.notices == [] and mx.array_equal(third.model(x), expected)


@pytest.mark.cpu_only
def test_a_start_with_float32_weights_builds_the_model_plain(home, quantized_model,
                                                             monkeypatch):
    """Once the CPU weights exist, a start builds the model's layers plain and loads them
    into it: nothing is quantized only to be replaced (control: the first start, which makes
    the weights, quantizes as mlx-lm does), and the model computes what the first one does."""
    quantized = []
    real = nn.quantize
    monkeypatch.setattr(nn, "quantize", lambda *a, **k: (quantized.append(1), real(*a, **k))[1])
    x = mx.array([[5, 17, 42, 99, 7]])
    first = Engine.load(str(quantized_model))
    assert quantized and first.notices == []
    quantized.clear()
    second = Engine.load(str(quantized_model))
    assert quantized == [] and second.notices == []
    layers = [m for _, m in second.model.named_modules()]
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in layers)
    assert sorted(type(m).__name__ for m in layers) == \
        sorted(type(m).__name__ for _, m in first.model.named_modules())
    assert mx.array_equal(second.model(x), first.model(x))


@pytest.mark.cpu_only
def test_float32_weights_that_do_not_fit_the_model_are_rebuilt_with_a_notice(home,
                                                                             quantized_model):
    """A weights file with a sound check but a layer of another shape (made by some other
    build of the model) is not loaded: one notice, rebuilt, the same replies."""
    from localchat.cpu import derived

    x = mx.array([[5, 17, 42, 99, 7]])
    fresh = Engine.load(str(quantized_model))
    expected = fresh.model(x)
    (cached,) = (home / "cpu-weights").glob("*.safetensors")
    dense = mx.load(str(cached))
    name = sorted(dense)[-1]
    dense[name] = dense[name][:, :-1]
    derived.save_checked(cached, dense, fresh.info().model_digest)
    again = Engine.load(str(quantized_model))
    assert len(again.notices) == 1, again.notices
    assert again.notices[0].startswith(f"CPU weights rebuilt: {cached.name} does not fit the "
                                       "model (Expected shape")
    assert mx.array_equal(again.model(x), expected)
    third = Engine.load(str(quantized_model))
    assert third.notices == [] and mx.array_equal(third.model(x), expected)


@pytest.mark.cpu_only
def test_preload_starts_the_read_that_the_load_takes_over(home, quantized_model, tiny_model,
                                                          monkeypatch):
    """``loading.preload`` (what ``ask`` calls before its imports) starts reading the CPU
    weights; the load of that model takes that read over instead of starting another
    (control: a load with no preload starts one). A preload for a model that is then not
    loaded is dropped, and a name that is not here yet starts nothing."""
    from localchat.model.preload import preload

    x = mx.array([[5, 17, 42, 99, 7]])
    expected = Engine.load(str(quantized_model)).model(x)  # makes the CPU weights
    started = []
    real = backend.Prefetch.__init__
    monkeypatch.setattr(backend.Prefetch, "__init__",
                        lambda self, *a: (started.append(a[0].name), real(self, *a))[1])
    preload(str(quantized_model))
    assert len(started) == 1
    engine = Engine.load(str(quantized_model))
    assert len(started) == 1 and engine.notices == [] and mx.array_equal(engine.model(x),
                                                                        expected)
    Engine.load(str(quantized_model))
    assert len(started) == 2  # the control: no preload, a read of its own
    preload(str(quantized_model))
    Engine.load(str(tiny_model))  # another model (unquantized: nothing to read)
    assert len(started) == 3
    Engine.load(str(quantized_model))
    assert len(started) == 4  # the early read was dropped, not kept for later
    preload("someone/not-downloaded")
    preload(str(home / "no-such-folder"))
    assert len(started) == 4


# -- the branches a Mac or a CUDA machine takes, run here with the backend check off -------


def test_other_backends_keep_quantized_weights_and_mlx_attention(home, quantized_model,
                                                                 monkeypatch):
    """``LOCALCHAT_CPU_PATH=off`` (what ``backend.cpu_path`` says on Metal/CUDA): quantized
    layers stay quantized, nothing is derived on disk, MLX's own attention stays, and the
    replies are the quantized model's."""
    from mlx_lm.utils import load_model

    from localchat.cpu import attention

    monkeypatch.setenv("LOCALCHAT_CPU_PATH", "off")
    assert backend.cpu_path() is False
    assert "MLX's own kernels" in backend.describe() and backend.blas_notice() is None
    was = attention.installed()
    attention.uninstall()
    try:
        engine = Engine.load(str(quantized_model))
        assert not attention.installed()
        assert mx.fast.scaled_dot_product_attention is attention.mlx_attention()
    finally:
        if was:
            monkeypatch.delenv("LOCALCHAT_CPU_PATH")
            attention.install()
    layers = [m for _, m in engine.model.named_modules()]
    assert any(isinstance(m, nn.QuantizedLinear) for m in layers)
    assert not (home / "cpu-weights").exists()
    reference, _ = load_model(quantized_model)
    x = mx.array([[5, 17, 42, 99, 7]])
    assert mx.array_equal(engine.model(x), reference(x))


def test_other_backends_load_no_blas(tmp_path):
    """No BLAS is loaded before MLX when the CPU path is off (a fresh process)."""
    import subprocess

    code = ("from localchat.cpu import backend; s = backend.prepare(); "
            "print(s.path, s.disabled, backend.blas_in_use())")
    env = {**os.environ, "LOCALCHAT_CPU_PATH": "off"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["None", "True", "None"], out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_other_backends_store_half_precision_kv_as_computed(home, tmp_path, dtype,
                                                              monkeypatch):
    """A half-precision model's K/V are stored in its own dtype (bfloat16 as on a Mac), and a
    resumed turn equals a full prefill."""
    from tiny import build_tiny_model
    from twins import full_prefill, run_turn

    from localchat import paths
    from localchat.session.session import Session
    from localchat.store.database import Store

    monkeypatch.setenv("LOCALCHAT_CPU_PATH", "off")
    folder = build_tiny_model(tmp_path / f"tiny-{dtype}", dtype=dtype)
    engine = Engine.load(str(folder))
    assert engine.info().kv_dtype == dtype
    store = Store.open(paths.database_path())

    def session():
        return Session(store, engine, paths.kv_root(), paths.locks_dir())

    conv = store.create("c", engine.ref.name)
    run_turn(session(), conv, "Hello there")
    assert session().cache_folder(conv).manifest().layout.dtype == dtype
    before = store.messages(conv)
    manifest = session().cache_folder(conv).folder.joinpath("manifest.json").read_text()
    resumed, notes = run_turn(session(), conv, "And then?")
    assert notes == [] and resumed.usage.cached_tokens > 0
    full = full_prefill(store, engine, conv, "And then?", before, manifest)
    assert resumed.tokens == full.tokens
    store.close()
