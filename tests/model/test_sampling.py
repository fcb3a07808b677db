"""What a request leaves out comes from the model: ``generation_config.json``, then localchat's
defaults — for the app and ``serve``; ``ask`` stays greedy; every reply has a cap."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from localchat.model.defaults import LOCALCHAT, MODEL, OURS, REPLY_CAP, model_defaults
from localchat.model.engine import Engine

ADVICE = {"temperature": 1.5, "top_p": 0.8, "top_k": 50, "min_p": 0.05,
          "repetition_penalty": 1.1, "max_new_tokens": 6, "eos_token_id": 2}


def with_config(src: Path, dst: Path, config) -> Path:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(
        config if isinstance(config, str) else json.dumps(config))
    return dst


def test_no_file_means_localchats_defaults(tiny_model):
    got = model_defaults(tiny_model)
    assert (got.temperature, got.top_p, got.max_tokens) == (
        LOCALCHAT["temperature"], LOCALCHAT["top_p"], REPLY_CAP)
    assert set(got.sources.values()) == {OURS} and got.notices == ()


def test_each_field_the_file_names_wins_and_the_rest_is_ours(tiny_model, tmp_path):
    for field, key in (("temperature", "temperature"), ("top_p", "top_p"),
                       ("top_k", "top_k"), ("min_p", "min_p"),
                       ("repetition_penalty", "repetition_penalty"),
                       ("max_tokens", "max_new_tokens")):
        folder = with_config(tiny_model, tmp_path / field, {key: ADVICE[key]})
        got = model_defaults(folder)
        assert getattr(got, field) == ADVICE[key]
        assert got.sources[field] == MODEL
        others = {k: v for k, v in got.sources.items() if k != field}
        assert set(others.values()) == {OURS}, field
    whole = model_defaults(with_config(tiny_model, tmp_path / "all", ADVICE))
    assert whole.describe()[0] == f"temperature 1.5 ({MODEL})"


def test_do_sample_false_means_greedy(tiny_model, tmp_path):
    got = model_defaults(with_config(tiny_model, tmp_path / "m",
                                     {"do_sample": False, "temperature": 0.6}))
    assert got.temperature == 0.0 and "do_sample" in got.sources["temperature"]


@pytest.mark.parametrize("bad", [
    {"temperature": "hot"}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5},
    {"top_k": 2.5}, {"top_k": True}, {"min_p": 2}, {"repetition_penalty": 0},
    {"max_new_tokens": 0}, {"temperature": [1]}])
def test_bad_values_fall_back_with_a_notice(tiny_model, tmp_path, bad):
    (key, value), = bad.items()
    got = model_defaults(with_config(tiny_model, tmp_path / "m", {**bad, "top_k": 7}
                                     if key != "top_k" else bad))
    assert set(got.sources.values()) <= {OURS, MODEL}
    field = "max_tokens" if key == "max_new_tokens" else key
    assert got.sources[field] == OURS and getattr(got, field) == LOCALCHAT[field]
    assert len(got.notices) == 1 and key in got.notices[0]
    assert "\n" not in got.notices[0]
    if key != "top_k":  # the file's good values still stand
        assert got.top_k == 7 and got.sources["top_k"] == MODEL


@pytest.mark.parametrize("text", ["{not json"])
def test_a_broken_file_is_one_notice_at_load(tiny_model, tmp_path, text):
    engine = Engine.load(str(with_config(tiny_model, tmp_path / "m", text)))
    assert any(n.startswith(MODEL) for n in engine.notices)
    assert engine.sampling().temperature == LOCALCHAT["temperature"]


def test_turn_fields_take_what_is_set(tiny_model, tmp_path):
    d = model_defaults(with_config(tiny_model, tmp_path / "m", ADVICE))
    assert d.turn_fields() == {"max_tokens": 6, "temp": 1.5, "top_p": 0.8, "top_k": 50,
                               "min_p": 0.05, "repetition_penalty": 1.1}
    assert d.turn_fields(temp=0.0, max_tokens=9)["temp"] == 0.0
    assert d.turn_fields(temp=0.0, max_tokens=9)["max_tokens"] == 9


async def test_the_app_samples_with_the_models_defaults(make_app):
    from test_tui import settle, type_and_send

    app, scripted = make_app(["Paris."])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "Capital of France?")
        await settle(app, pilot)
    assert scripted.sampled_with == [{"temp": LOCALCHAT["temperature"],
                                      "top_p": LOCALCHAT["top_p"]}]
    app, scripted = make_app(["Paris."], temp=0.0)  # negative control: the user's setting
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "Capital of France?")
        await settle(app, pilot)
    assert scripted.sampled_with[0]["temp"] == 0.0


def test_serve_fills_what_a_request_omits_from_the_model(server, kinds, tmp_path):
    folder = with_config(kinds["llama"], tmp_path / "advised", ADVICE)
    s = server("llama", model=folder)
    with urllib.request.urlopen(f"{s.url}/v1/models", timeout=30) as r:
        card = json.loads(r.read())["data"][0]
    assert card["max_tokens"] == 6
    assert card["defaults"]["temperature"] == {"value": 1.5, "source": MODEL}
    client = s.openai()
    ask = [{"role": "user", "content": "Tell me about Seoul."}]
    left_out = client.chat.completions.create(model="localchat", messages=ask, seed=3)
    assert left_out.usage.completion_tokens <= 6
    said = client.chat.completions.create(
        model="localchat", messages=ask, seed=3, temperature=1.5, top_p=0.8, max_tokens=6,
        extra_body={"top_k": 50, "min_p": 0.05, "repetition_penalty": 1.1})
    assert said.choices[0].message.content == left_out.choices[0].message.content
    greedy = client.chat.completions.create(model="localchat", messages=ask, temperature=0,
                                            max_tokens=6)
    assert greedy.choices[0].message.content != left_out.choices[0].message.content
    claude = s.anthropic()
    msg = claude.messages.create(model="localchat", messages=ask, max_tokens=64,
                                 extra_body={"top_k": 1})
    assert msg.usage.output_tokens <= 64


# -- the embedded default model's advice (its model card's; the GGUF has none) --------------

def test_the_default_models_advice_is_written_once_and_named_by_its_source(tiny_model, tmp_path):
    from localchat.model import gguf

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    assert gguf.write_sampling_advice(folder) is True
    got = model_defaults(folder)
    source = f"{MODEL}: {gguf.SAMPLING_SOURCE}"
    assert (got.temperature, got.top_p) == (0.2, 0.9)
    assert got.sources["temperature"] == got.sources["top_p"] == source
    assert got.sources["top_k"] == OURS  # what the card does not name stays ours
    assert got.describe()[0] == f"temperature 0.2 ({source})"
    stamp = (folder / MODEL).stat().st_mtime_ns
    assert gguf.write_sampling_advice(folder) is False  # current: left as it is
    assert (folder / MODEL).stat().st_mtime_ns == stamp


def test_a_file_the_user_wrote_stands_and_an_older_advice_is_replaced(tiny_model, tmp_path,
                                                                     monkeypatch):
    from localchat.model import gguf

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    (folder / MODEL).write_text(json.dumps({"temperature": 0.5}))  # not ours: kept
    assert gguf.write_sampling_advice(folder) is False
    assert model_defaults(folder).temperature == 0.5
    (folder / MODEL).write_text("[1, 2]")  # not an object: not ours either
    assert gguf.write_sampling_advice(folder) is False
    monkeypatch.setattr(gguf, "SAMPLING_VERSION", 0)
    (folder / MODEL).unlink()
    assert gguf.write_sampling_advice(folder) is True  # version 0 written
    monkeypatch.setattr(gguf, "SAMPLING_VERSION", 1)
    assert gguf.write_sampling_advice(folder) is True  # an older advice: rewritten
    assert json.loads((folder / MODEL).read_text())["localchat"]["version"] == 1


def test_the_advice_leaves_the_model_digest_as_it_was(tiny_model, tmp_path):
    from localchat.model import gguf
    from localchat.model.resolve import model_digest

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    before = model_digest(folder)
    gguf.write_sampling_advice(folder)
    assert model_digest(folder) == before
    # Negative control: the makers' file with the same values is part of the digest.
    (folder / MODEL).write_text(json.dumps(gguf.SAMPLING_ADVICE))
    assert model_digest(folder) != before


def default_turn(prompt: str, name: str = "c"):
    from localchat.session.session import TurnFinished, TurnOptions, open_session

    session = open_session(None)
    try:
        conv = session.conversation(name)
        events = list(session.turn(conv, prompt, TurnOptions(max_tokens=8)))
        sampling = session.engine.sampling()
    finally:
        session.close()
    done = events[-1]
    assert isinstance(done, TurnFinished)
    return done, sampling


def test_a_default_folder_converted_before_gets_the_advice_and_keeps_its_caches(
        tiny_model, home, monkeypatch):
    """The upgrade path: the default model's folder was converted by a localchat without the
    advice and holds a conversation's cache; the next start writes the advice, samples with
    it, and the conversation's next turn still appends to its cache."""
    from localchat.model import gguf

    folder = home / "models" / gguf.DEFAULT_DIR_NAME
    shutil.copytree(tiny_model, folder)
    with monkeypatch.context() as m:  # an earlier localchat: no advice
        m.setattr(gguf, "write_sampling_advice", lambda f: False)
        first, before = default_turn("What is the capital of France?")
    assert not (folder / MODEL).exists() and before.temperature == LOCALCHAT["temperature"]
    second, after = default_turn("And of Korea?")
    assert (after.temperature, after.top_p) == (0.2, 0.9)
    assert after.sources["temperature"] == f"{MODEL}: {gguf.SAMPLING_SOURCE}"
    u1, u2 = first.usage, second.usage
    assert u2.cached_tokens >= u1.prompt_tokens + u1.completion_tokens - 2, u2
    assert not u2.miss_reason
    # Negative control: a makers' file (no mark) changes the model, so the cache is rebuilt.
    (folder / MODEL).write_text(json.dumps(gguf.SAMPLING_ADVICE))
    third, _ = default_turn("And of Japan?")
    assert third.usage.cached_tokens == 0 and third.usage.miss_reason


def test_inspect_names_the_default_models_advice(tiny_model, home):
    import os
    import subprocess
    import sys

    from localchat.model import gguf

    shutil.copytree(tiny_model, home / "models" / gguf.DEFAULT_DIR_NAME)
    out = subprocess.run([sys.executable, "-m", "localchat", "inspect", "--json"],
                         env={**os.environ, "LOCALCHAT_HOME": str(home)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    defaults = json.loads(out.stdout)["sampling_defaults"]
    assert defaults["temperature"] == {"value": 0.2,
                                       "source": f"{MODEL}: {gguf.SAMPLING_SOURCE}"}
    assert defaults["min_p"]["source"] == OURS


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mark=_json, extra=st.dictionaries(st.sampled_from(["temperature", "top_p", "x"]),
                                          _json, max_size=2),
       raw=st.one_of(st.none(), st.binary(max_size=40)))
@example(mark={"version": False}, extra={}, raw=None)
@example(mark={"version": 0}, extra={"temperature": "hot"}, raw=None)
@example(mark=None, extra={}, raw=b"[1, 2]")
def test_any_generation_config_is_judged_without_an_exception(tmp_path, mark, extra, raw):
    """The file read back for the sampling advice and the digest holds anything: JSON of every
    type under our key, beside other fields, or bytes that are not JSON. Writing the advice
    answers a bool (and writes only over our own older version); the digest's check answers a
    bool; a file the advice replaced is then ours, current, and left out of the digest."""
    from localchat.model import gguf
    from localchat.model import resolve as models
    from localchat.model.defaults import WRITTEN

    path = tmp_path / "generation_config.json"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text(json.dumps({**extra, WRITTEN: mark}))
    before = path.read_bytes()
    ours_before = models._sampling_only(path)
    assert isinstance(ours_before, bool)
    older = (raw is None and isinstance(mark, dict) and type(mark.get("version")) is int
             and mark["version"] < gguf.SAMPLING_VERSION)
    wrote = gguf.write_sampling_advice(tmp_path)
    assert wrote == older
    if wrote:
        assert models._sampling_only(path)
        assert json.loads(path.read_text())[WRITTEN]["version"] == gguf.SAMPLING_VERSION
    else:
        assert path.read_bytes() == before  # a file not ours (or current) stands


@st.composite
def scores(draw):
    """Rows of float32 logits: a vocabulary of any size, any scale, ties and masked tokens."""
    rows = draw(st.integers(1, 3))
    width = draw(st.sampled_from([1, 2, 7, 100, 1000, 3000]))  # (each shape compiles once)
    scale = draw(st.sampled_from([0.01, 1.0, 5.0, 30.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    a = (rng.normal(0, scale, (rows, width))).astype(np.float32)
    if draw(st.booleans()):  # ties: values from a handful
        a = np.round(a, 0).astype(np.float32)
    if width > 1 and draw(st.booleans()):  # banned tokens (``Sampler.masked``)
        a[:, rng.integers(0, width, max(1, width // 10))] = -np.inf
    return a


@settings(max_examples=100, deadline=None)
@given(a=scores(), p=st.sampled_from([0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99]))
# (mlx-lm's apply_top_p is compiled: each new p compiles it again)
def test_top_p_is_mlx_lms_to_the_bit(a, p):
    """Our top-p (NumPy's sort on the CPU path) keeps exactly the tokens mlx-lm's keeps, with
    the same values; control: another p keeps another set somewhere below."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_p

    from localchat.model.sampler import _host_sort, top_p_filter

    assert _host_sort()  # (the NumPy path is the one under test)
    x = mx.array(a)
    ours, theirs = np.array(top_p_filter(x, p)), np.array(apply_top_p(x, p))
    assert np.array_equal(ours, theirs)


def test_top_p_control_tells_a_different_p_apart():
    import mlx.core as mx

    from localchat.model.sampler import top_p_filter

    x = mx.array(np.random.default_rng(1).normal(0, 2, (1, 4000)).astype(np.float32))
    assert not np.array_equal(np.array(top_p_filter(x, 0.5)), np.array(top_p_filter(x, 0.9)))


def test_a_seeded_sampled_draw_is_mlx_lms_draw():
    """``Sampler`` draws what mlx-lm's own sampler chain draws from the same random state."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from localchat.model.sampler import Sampler

    logits = mx.array(np.random.default_rng(2).normal(0, 3, (1, 49152)).astype(np.float32))
    got, want = [], []
    for seed in range(40):
        got.append(int(Sampler(0.7, 0.9, seed=seed).draw(logits).item()))
        mx.random.seed(seed * 1_000_003 % 2**63)
        want.append(int(make_sampler(0.7, top_p=0.9)(logits).item()))
    assert got == want and len(set(got)) > 3  # (and the draws do vary)
