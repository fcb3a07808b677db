"""The small files localchat reads back, each field changed: never a wrong verdict, a wrong
digest or a traceback, and the file is rebuilt.

- ``kv-quality.json`` (``kvcache/quality.py``): a setting that fails the quality gate keeps failing
  whatever the remembered measurement is changed to; the measurement runs again and the entry
  is written back as it was.
- ``digests.json`` (``model/resolve.py``): the model digest is the one a fresh hash gives; a
  weights file replaced by another of the same size and modification time is hashed again.
- ``cpu-weights/*.check.json`` (``cpu/derived.py``): any change refuses the derived file with one
  line; through ``Engine.load`` it is rebuilt with the "CPU weights rebuilt" notice.
"""

from __future__ import annotations

import json
import os
import shutil

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import build_tiny_model

from localchat import paths
from localchat.cpu import derived
from localchat.errors import BadInput
from localchat.kvcache import quality as kvquality
from localchat.kvcache.kinds import KVQuant
from localchat.model import resolve as models
from localchat.model.engine import Engine

_GONE = object()


def field_changes(entry: dict) -> list[tuple[str, object]]:
    """(label, changed entry) for every field of a JSON object: removed, another type, a
    number off, a character changed, emptied; and the object's own shape."""
    out = [("extra key", {**entry, "extra": 1}), ("emptied", {}), ("a list", list(entry)),
           ("null", None), ("a string", "x")]
    for k, v in entry.items():
        news: list = [_GONE, None, True, [v], {"v": v}]
        if type(v) in (int, float):
            news += [v + 1, v - 1, -v - 1, float(v) if type(v) is int else int(v), str(v),
                     0.0, 1.0, 0]
        if type(v) is str:
            news += ["", v[:-1] + chr(ord(v[-1]) ^ 1), v.upper(), 0]
        if type(v) is list:
            news += [[], v[:-1], v + v[-1:]]
        for new in news:
            changed = {**entry}
            if new is _GONE:
                del changed[k]
            else:
                changed[k] = new
            if json.dumps(changed) != json.dumps(entry):  # (5.0 == 5 and True == 1 in Python)
                out.append((f"{k}: {new!r}"[:60], changed))
    return out


def item_changes(items: list) -> list[tuple[str, object]]:
    """(label, changed list) for every item of a JSON list, and the list's own shape."""
    out = [("emptied", []), ("one item", items[:1]), ("one more", items + items[-1:]),
           ("an object", dict(enumerate(items))), ("null", None), ("the first item", items[0])]
    for i, v in enumerate(items):
        for new in ["", v[:-1] + chr(ord(v[-1]) ^ 1), v.upper(), 0, None, [v]]:
            if new != v:
                out.append((f"item {i}: {new!r}"[:60], items[:i] + [new] + items[i + 1:]))
    return out


# -- kv-quality.json ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Head dim 32, so 4-bit groups of 32 fit and do change the predictions."""
    folder = build_tiny_model(tmp_path_factory.mktemp("q") / "q", hidden=128, heads=4,
                              kv_heads=2)
    return Engine.load(str(folder))


def test_a_changed_quality_memo_never_makes_a_failing_setting_pass(home, wide, monkeypatch):
    quant = KVQuant(4, 32)
    measured = kvquality.measure(wide, quant)
    assert measured.nll_delta > 0 and measured.positions > 10
    # The gate set just past this model's figures: 4 bits fail, by a hair.
    monkeypatch.setitem(kvquality.GATE, "nll", measured.nll_delta / 2)
    with pytest.raises(BadInput, match="fails the quality gate"):
        kvquality.check(wide, quant)
    memo_file = paths.data_home() / "kv-quality.json"
    memo = json.loads(memo_file.read_text())
    (key, entry), = memo.items()
    assert {k: entry[k] for k in ("agreement", "nll_delta", "positions")} == measured.__dict__
    passing = {**entry, "agreement": 1.0, "nll_delta": 0.0}  # what an edit would make of it
    cases = [(f"entry {label}", {key: new}) for label, new in field_changes(entry)] + [
        ("passing figures, old check", {key: passing}),
        ("under another key", {key.replace("|4|", "|8|"): passing}),
        ("file: a list", [passing]), ("file: null", None)]
    for label, content in cases:
        memo_file.write_text(json.dumps(content))
        with pytest.raises(BadInput, match="fails the quality gate"):
            kvquality.check(wide, quant)
        assert json.loads(memo_file.read_text())[key] == entry, label  # measured again
    for text in ("", "{", "\x00\xff", '{"a": NaN}'):
        memo_file.write_text(text)
        with pytest.raises(BadInput, match="fails the quality gate"):
            kvquality.check(wide, quant)
        assert json.loads(memo_file.read_text())[key] == entry
    # Negative control: the entry itself, untouched, is what makes it fail without measuring.
    monkeypatch.setattr(kvquality, "measure", None)  # would fail loudly if called
    with pytest.raises(BadInput, match="fails the quality gate"):
        kvquality.check(wide, quant)


# -- digests.json ----------------------------------------------------------------------


def test_a_changed_digest_memo_never_changes_the_model_digest(home, tiny_model, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    memo_file = paths.digests_path()
    truth = models.model_digest(folder)
    memo = json.loads(memo_file.read_text())
    (key, entry), = memo.items()
    other = "0" * 64  # a well-formed hash of something else
    cases = [(f"entry {label}", {key: new}) for label, new in item_changes(entry)] + [
        ("another hash, old check", {key: [other, entry[1]]}),
        ("under the key of another file", {key.replace("model.", "other."): entry}),
        ("file: a list", [entry])]
    for label, content in cases:
        memo_file.write_text(json.dumps(content))
        assert models.model_digest(folder) == truth, label
        assert json.loads(memo_file.read_text())[key] == entry, label  # hashed, rewritten
    for text in ("", "{", "\x00\xff", "[]"):
        memo_file.write_text(text)
        assert models.model_digest(folder) == truth
        assert json.loads(memo_file.read_text()) == memo  # the unreadable file replaced


def test_weights_replaced_with_the_same_size_and_time_are_hashed_again(home, tiny_model,
                                                                       tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    before = models.model_digest(folder)
    weights = folder / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # another model, byte for byte as long
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # as `cp -p` or `rsync -t` keeps it
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    after = models.model_digest(folder)
    paths.digests_path().unlink()
    assert after != before and after == models.model_digest(folder)


# -- cpu-weights/*.check.json ----------------------------------------------------------------


def test_every_changed_sidecar_field_refuses_the_derived_file(tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = {"w": mx.arange(1000, dtype=mx.float32)}
    derived.save_checked(path, tensors, "source-a")
    side = path.with_name(path.name + ".check.json")
    meta = json.loads(side.read_text())
    assert mx.array_equal(derived.load_checked(path, "source-a")["w"], tensors["w"])  # control
    cases = [(label, json.dumps(new)) for label, new in field_changes(meta)] + [
        ("empty", ""), ("garbage", "\x00\xff"), ("truncated", side.read_text()[:20]),
        ("NaN size", json.dumps(meta).replace(str(meta["nbytes"]), "NaN")),
        ("deep", "[" * 100_000 + "]" * 100_000)]
    for label, text in cases:
        side.write_text(text)
        with pytest.raises(derived.DerivedDamaged) as err:
            derived.load_checked(path, "source-a")
        assert "\n" not in str(err.value) and str(err.value).startswith(path.name), label
    side.write_text(json.dumps(meta))
    with pytest.raises(derived.DerivedDamaged, match="another model"):
        derived.load_checked(path, "source-b")


def _flip_bit(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))


def _refused(path, source: str) -> str:
    """The one-line reason ``load_checked`` refuses ``path`` with (the test fails if it is
    taken)."""
    with pytest.raises(derived.DerivedDamaged) as err:
        derived.load_checked(path, source)
    assert "\n" not in str(err.value) and str(err.value).startswith(path.name)
    return str(err.value)


def test_one_flipped_bit_anywhere_refuses_the_derived_file(tmp_path):
    """In the header, the first and last weight bytes, the middle: each refused with one line;
    the file flipped back is taken again (the control)."""
    path = tmp_path / "w.safetensors"
    tensors = {"a": mx.arange(70_000, dtype=mx.float32), "b": mx.ones((3, 5), mx.float32)}
    derived.save_checked(path, tensors, "src")
    size = path.stat().st_size
    hlen = int.from_bytes(path.read_bytes()[:8], "little")
    for at in (3, 8 + hlen // 2, 8 + hlen, size // 2, size - 1):
        _flip_bit(path, at)
        assert _refused(path, "src") == "w.safetensors is damaged (checksum)", at
        _flip_bit(path, at)
        got = derived.load_checked(path, "src")
        assert all(mx.array_equal(got[k], tensors[k]) for k in tensors), at


def test_words_swapped_inside_a_mib_are_caught(tmp_path):
    """Two 8-byte words swapped: the earlier per-MiB-sum digest could not see it (its sums do
    not change: the control that this damage is a hard one), the current check refuses it."""
    path = tmp_path / "w.safetensors"
    derived.save_checked(path, {"a": mx.arange(100_000, dtype=mx.float32)}, "src")
    before = derived._sum_digest(path)
    data = bytearray(path.read_bytes())
    i, j = len(data) // 8 * 8 - 64, len(data) // 8 * 8 - 128
    assert data[i:i + 8] != data[j:j + 8]
    data[i:i + 8], data[j:j + 8] = data[j:j + 8], data[i:i + 8]
    path.write_bytes(bytes(data))
    assert derived._sum_digest(path) == before
    _refused(path, "src")


def test_a_sidecar_of_the_earlier_kind_is_checked_that_way_once(tmp_path):
    """A file an earlier version wrote (sidecar ``digest``: the per-MiB sums) is taken after
    that check and its sidecar becomes the current kind; damaged, it is refused as before."""
    path = tmp_path / "w.safetensors"
    tensors = {"a": mx.arange(300_000, dtype=mx.float32)}
    derived.save_checked(path, tensors, "src")
    side = path.with_name(path.name + ".check.json")
    current = json.loads(side.read_text())
    assert current.keys() == {"source", "nbytes", "xxh3"}
    earlier = {"source": "src", "nbytes": current["nbytes"], "digest": derived._sum_digest(path)}
    side.write_text(json.dumps(earlier))
    assert mx.array_equal(derived.load_checked(path, "src")["a"], tensors["a"])
    assert json.loads(side.read_text()) == current  # upgraded: the next start checks fast
    side.write_text(json.dumps(earlier))
    _flip_bit(path, path.stat().st_size // 2)
    assert _refused(path, "src") == "w.safetensors is damaged (checksum)"
    assert json.loads(side.read_text()) == earlier  # (refused: nothing written)
    mixed = {**earlier, "xxh3": current["xxh3"]}  # both kinds at once: not a sidecar we wrote
    side.write_text(json.dumps(mixed))
    assert _refused(path, "src") == "w.safetensors has a damaged check file"


def test_checking_the_cpu_weights_imports_no_numpy(tmp_path):
    """The check runs on a thread while the start imports: numpy (0.2-0.3 s of imports
    under the GIL) is not among its imports. Control: the earlier kind of sidecar needs it."""
    import subprocess
    import sys

    path = tmp_path / "w.safetensors"
    derived.save_checked(path, {"a": mx.arange(1000, dtype=mx.float32)}, "src")
    code = ("import sys; from pathlib import Path; from localchat.cpu import derived; "
            "d = derived.load_checked(Path(sys.argv[1]), 'src'); "
            "print(int(d['a'].sum().item()), 'numpy' in sys.modules)")

    def run() -> str:
        out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run() == "499500 False"
    side = path.with_name(path.name + ".check.json")
    meta = json.loads(side.read_text())
    side.write_text(json.dumps({"source": "src", "nbytes": meta["nbytes"],
                                "digest": derived._sum_digest(path)}))
    assert run() == "499500 True"


@pytest.mark.cpu_only  # (the CPU weights exist on the CPU path only)
@pytest.mark.parametrize("change", ["a list", "size as a float", "size as a bool"])
def test_a_changed_sidecar_rebuilds_the_cpu_weights_with_a_notice(home, quantized_model,
                                                                  change):
    x = mx.array([[5, 17, 42, 99, 7]])
    fresh = Engine.load(str(quantized_model))
    expected = fresh.model(x)
    (side,) = (home / "cpu-weights").glob("*.check.json")
    meta = json.loads(side.read_text())
    if change == "a list":
        side.write_text(json.dumps(list(meta.values())))
    else:  # a size that compares equal to the right one
        side.write_text(json.dumps({**meta, "nbytes": float(meta["nbytes"]) if "float" in change
                                    else True}))
    again = Engine.load(str(quantized_model))
    assert len(again.notices) == 1 and again.notices[0].startswith("CPU weights rebuilt:")
    assert mx.array_equal(again.model(x), expected)
    assert json.loads(side.read_text()) == meta  # rebuilt: the same file, a sound check
    assert Engine.load(str(quantized_model)).notices == []


def test_the_weights_are_checked_in_memory_without_reading_the_file_twice(tmp_path,
                                                                          monkeypatch):
    """A file ``save_checked`` wrote is read once: its digest is taken over what MLX read (the
    file's digest, recomputed: ``derived.digest`` is never called), and a flipped data byte
    is refused that way. The control: a header that is not float32 end to end is hashed
    through the file as before."""
    path = tmp_path / "w.safetensors"
    tensors = {"b": mx.ones((3, 5), mx.float32), "a": mx.arange(70_000, dtype=mx.float32)}
    derived.save_checked(path, tensors, "src")
    calls = []
    real = derived._KINDS["xxh3"]
    monkeypatch.setitem(derived._KINDS, "xxh3", (real[0], lambda p: calls.append(p) or
                                                 real[1](p)))
    got = derived.load_checked(path, "src")
    assert all(mx.array_equal(got[k], tensors[k]) for k in tensors) and calls == []
    _flip_bit(path, path.stat().st_size - 3)
    assert _refused(path, "src") == "w.safetensors is damaged (checksum)" and calls == []
    _flip_bit(path, path.stat().st_size - 3)
    other = tmp_path / "h.safetensors"
    derived.save_checked(other, {"h": mx.ones((4,), mx.float16)}, "src")
    assert mx.array_equal(derived.load_checked(other, "src")["h"], mx.ones((4,), mx.float16))
    assert calls == [other]


@pytest.mark.parametrize("header", [
    {"a": 5}, {"a": None}, {"a": {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}},
    {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}},
    {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
    {"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}},
    {"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}},
    {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
     "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
    {"__metadata__": {"x": "y"}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
    [1, 2], "text"])
def test_a_header_of_any_shape_with_a_matching_digest_is_one_line_or_read(tmp_path, header):
    """Headers a crafted or damaged file could carry, with a sidecar that matches their bytes
    (so only the layout is wrong): each is read as MLX reads it or refused in one line, never
    an exception of another kind."""
    path = tmp_path / "w.safetensors"
    body = json.dumps(header).encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + b"\x00\x00\x80\x3f")
    meta = {"source": "src", "nbytes": path.stat().st_size, "xxh3": derived.digest(path)}
    path.with_name(path.name + ".check.json").write_text(json.dumps(meta))
    try:
        got = derived.load_checked(path, "src")
    except derived.DerivedDamaged as err:
        assert "\n" not in str(err) and str(err).startswith(path.name)
    else:
        assert isinstance(got, dict)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)
_ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "F16", "I8"]) | _JSON,
    "shape": st.lists(st.integers(-2, 3), max_size=2) | _JSON,
    "data_offsets": st.lists(st.integers(-8, 16), max_size=3) | _JSON})


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.text(max_size=4), _ENTRY | _JSON, max_size=3) | _JSON,
       data=st.binary(max_size=16))
def test_generated_headers_with_a_matching_digest_are_read_or_refused_in_one_line(
        tmp_path, header, data):
    """Headers of every JSON type and entries of every wrong field, their digest matching:
    read as MLX reads them, or refused in one line."""
    path = tmp_path / "g.safetensors"
    body = json.dumps(header).encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + data)
    meta = {"source": "src", "nbytes": path.stat().st_size, "xxh3": derived.digest(path)}
    path.with_name(path.name + ".check.json").write_text(json.dumps(meta))
    try:
        got = derived.load_checked(path, "src")
    except derived.DerivedDamaged as err:
        assert "\n" not in str(err) and str(err).startswith(path.name)
    else:
        assert isinstance(got, dict)
