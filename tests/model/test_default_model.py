"""The real embedded default model, end to end through the CLI (slow: converts ~100 MB).

Part of the default run (and CI); ``pytest -m "not slow"`` skips it.
"""

import json
import os
import subprocess
import sys

import pytest


def localchat(home, *args):
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "localchat", *args], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One data folder for the module: the default model is converted once."""
    return tmp_path_factory.mktemp("real") / "home"


@pytest.mark.slow
def test_default_model_answers_and_resumes(home):
    first = localchat(home, "ask", "-c", "fr", "--json", "What is the capital of France?")
    assert first.returncode == 0, first.stderr
    one = json.loads(first.stdout)
    assert "Paris" in one["reply"]
    second = localchat(home, "ask", "-c", "fr", "--json", "And of Germany?")
    two = json.loads(second.stdout)
    u1, u2 = one["usage"], two["usage"]
    # The whole first turn (prompt + reply, less the unfed end-of-turn token) is reused.
    assert u2["cached_tokens"] >= u1["prompt_tokens"] + u1["completion_tokens"] - 3
    new_message = len("\n<|im_start|>user\nAnd of Germany?<|im_end|>\n<|im_start|>assistant\n")
    assert u2["prefilled_tokens"] < new_message  # tokens, far fewer than characters
    assert "Berlin" in two["reply"]


@pytest.mark.slow
def test_default_model_answers_paris_with_an_8_bit_cache(home):
    first = localchat(home, "ask", "-c", "q8", "--kv-bits", "8", "--json",
                      "What is the capital of France?")
    assert first.returncode == 0, first.stderr
    assert "Paris" in json.loads(first.stdout)["reply"]
    second = localchat(home, "ask", "-c", "q8", "--json", "And of Germany?")
    two = json.loads(second.stdout)
    assert two["usage"]["cached_tokens"] >= json.loads(first.stdout)["usage"]["prompt_tokens"]
    assert "Berlin" in two["reply"]


@pytest.mark.slow
def test_the_converted_default_model_samples_as_its_card_advises(home):
    """The conversion writes the model card's sampling (the GGUF has none); `inspect` names it."""
    out = localchat(home, "inspect", "--json")
    assert out.returncode == 0, out.stderr
    defaults = json.loads(out.stdout)["sampling_defaults"]
    card = "generation_config.json: SmolLM2-135M-Instruct model card"
    assert defaults["temperature"] == {"value": 0.2, "source": card}
    assert defaults["top_p"] == {"value": 0.9, "source": card}
    assert defaults["top_k"]["source"] == "localchat default"  # the card names none
    written = json.loads((home / "models" / "smollm2-135m" / "generation_config.json").read_text())
    assert written["localchat"]["version"] == 1
