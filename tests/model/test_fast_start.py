"""A start imports no transformers where the tokenizer does not need it; ``inspect`` says
which path the tokenizer took; a folder the fast path cannot take still loads (through
transformers, as before), with the same ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localchat.cli.main import main

ROOT = Path(__file__).parents[2]


def imported(tiny_model: Path, home: Path, *args: str) -> tuple[set[str], str]:
    """Top-level packages ``localchat ARGS`` imports (``-X importtime``), and its stdout."""
    env = {**os.environ, "LOCALCHAT_HOME": str(home),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "localchat", *args],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    names = {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines()
             if line.startswith("import time:") and "self [us]" not in line}
    return names, out.stdout


def test_ask_resumed_imports_no_transformers(tiny_model, tmp_path):
    home = tmp_path / "home"
    args = ("ask", "-m", str(tiny_model), "-c", "fast", "--max-tokens", "3")
    first, _ = imported(tiny_model, home, *args, "Hello")
    again, out = imported(tiny_model, home, *args, "And again?")
    assert "mlx_lm" in again and "tokenizers" in again and "jinja2" in again  # it did run
    assert "transformers" not in first | again, sorted(first | again)
    assert "huggingface_hub" not in again
    # Images (docs/images.md): a text model's start imports neither mlx-vlm nor Pillow.
    assert not {"mlx_vlm", "PIL"} & (first | again), sorted(first | again)


def test_negative_control_mlx_lms_package_root_imports_transformers(tmp_path):
    """Importing a model module the usual way runs mlx-lm's root, which imports
    transformers: the test above could fail."""
    code = "import sys, mlx_lm.models.llama; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip() == "True"


def test_inspect_shows_the_tokenizer_path(home, tiny_model, capsys):
    assert main(["inspect", "-m", str(tiny_model), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tokenizer"].startswith("tokenizers + jinja2 (")
    assert main(["inspect", "-m", str(tiny_model)]) == 0
    assert "tokenizer            tokenizers + jinja2" in capsys.readouterr().out


def test_a_tokenizer_class_of_its_own_loads_through_transformers(home, tiny_model, tmp_path,
                                                                  capsys):
    """A folder whose tokenizer class transformers builds its own way goes through
    transformers (the ids are transformers'), and ``inspect`` says why."""
    import shutil

    folder = tmp_path / "own-class"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["inspect", "-m", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tokenizer"].startswith("transformers (tokenizer class Qwen2Tokenizer")
    assert main(["ask", "-m", str(folder), "-c", "q", "--max-tokens", "2", "Hi"]) == 0


def test_an_edited_check_entry_is_no_check(home, tiny_model, tmp_path):
    """``tokenizer-checks.json`` read back: an entry turned to "same" by hand is not taken
    (the fast path only where transformers was seen to agree)."""
    import shutil

    from localchat import paths
    from localchat.model.tokenizer import SLOW, load_tokenizer, plan

    folder = tmp_path / "own-class"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"  # rebuilds its pre-tokenizer: not the same
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    load_tokenizer(folder)
    memo = json.loads(paths.tokenizer_checks_path().read_text())
    assert [v[0] for v in memo.values()] != ["same"]
    for bad in (["same", "0" * 16], "same", ["same"], {"same": 1}):
        paths.tokenizer_checks_path().write_text(json.dumps({k: bad for k in memo}))
        assert plan(folder).path == SLOW


def test_a_damaged_code_cache_is_compiled_again(home):
    """mlx-lm's compiled code is read back only when its checksum holds."""
    import hashlib
    import importlib.util

    from localchat import paths
    from localchat.model import mlxlm

    mlxlm.install_root()
    source = Path(importlib.util.find_spec("mlx_lm").submodule_search_locations[0]) / "utils.py"
    good = mlxlm._code(source, "utils")
    (cached,) = paths.code_cache_dir().glob("utils-*.code")
    for damage in (b"", b"\0" * 40, cached.read_bytes()[:-7] + b"garbage"):
        cached.write_bytes(damage)
        again = mlxlm._code(source, "utils")
        assert again.co_names == good.co_names and "load_model" in again.co_names
        blob = cached.read_bytes()
        assert hashlib.sha256(blob[32:]).digest() == blob[:32]  # written back whole
    # the heavy imports are not in it: compiled code runs no transformers import
    assert not any("transformers" in str(c) for c in good.co_consts if isinstance(c, str))


def test_the_template_compiled_early_is_the_one_a_render_takes(tiny_model, tmp_path):
    """``compile_template`` (run while the CPU weights are read) compiles what the first
    render would: that render finds it compiled. A template that does not compile is left
    for the render to report (the control: the render does raise)."""
    import shutil

    from jinja2 import TemplateError

    from localchat.model.tokenizer import load_tokenizer, template

    tok, _ = load_tokenizer(tiny_model)
    template.compiled.cache_clear()
    tok.compile_template()
    assert template.compiled.cache_info().currsize == 1
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    info = template.compiled.cache_info()
    assert "Hi" in text and info.currsize == 1 and info.hits >= 1
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if %}broken"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    broken, _ = load_tokenizer(folder)
    broken.compile_template()  # no error here
    with pytest.raises(TemplateError):
        broken.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
