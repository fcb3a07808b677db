"""mlx-lm's modules without its package root, so a start imports no transformers.

What it is: importing any ``mlx_lm.*`` module runs ``mlx_lm/__init__.py``, which imports
``generate`` and ``utils``, which import transformers and huggingface_hub (~1.2 s of a ~2.5 s
start). ``install_root`` puts a stand-in for the package root in ``sys.modules``: a module
with the real package's ``__path__`` (so ``mlx_lm.models.llama`` or ``mlx_lm.sample_utils``
import from the installed files as usual) whose root names (``load``, ``generate``, …) are
imported from their submodules when first asked for, as the real root would have them. A
process that imported the real root first keeps it.

``utils()`` and ``tokenizer_utils()`` are mlx-lm's own ``utils.py`` and ``tokenizer_utils.py``,
compiled from the installed source without the top-level statements that import transformers
or huggingface_hub (and the transformers subclass and registration that need it): the same
``load_model``, ``TokenizerWrapper``, reasoning-marker and tool-parser inference the slow path
runs, so the two paths cannot drift apart as mlx-lm changes. What was left out is only reached
through functions localchat does not call here (``load``, Hub downloads, transformers'
``AutoTokenizer``); a source that no longer has what we need raises ``ImportError`` and the
caller takes the transformers path. Not registered in ``sys.modules``: the real modules stay
importable (the transformers fallback, ``batch --parallel``).

What it is not: a copy of mlx-lm. Run ``python -X importtime -m localchat ask …`` to see that
no transformers is imported.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import marshal
import os
import sys
import types
from pathlib import Path

from ..files import atomic_write
from ..paths import code_cache_dir

# The real root's names and the submodules they come from (``mlx_lm/__init__.py``).
_ROOT_NAMES = {"convert": "convert", "batch_generate": "generate", "generate": "generate",
               "stream_generate": "generate", "load": "utils"}
# Top-level imports left out of the compiled copies (they import transformers or the Hub).
_HEAVY = ("transformers", "huggingface_hub", "modelscope", "tokenizer_utils")
FILTER = 1  # bump when ``_heavy`` changes: the cached code is compiled again


def install_root() -> None:
    """Make ``import mlx_lm.<sub>`` skip ``mlx_lm/__init__.py`` (once; idempotent)."""
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return  # not installed: the import fails where it is made, as before
    root = importlib.util.module_from_spec(spec)
    root.__getattr__ = functools.partial(_root_attr, root)  # type: ignore[attr-defined]
    root.__all__ = ["__version__", *_ROOT_NAMES]  # type: ignore[attr-defined]
    # What the real root does first, so transformers, if it is loaded later, behaves the same.
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    sys.modules["mlx_lm"] = root
    try:
        root.__version__ = importlib.import_module("mlx_lm._version").__version__  # type: ignore
    except ImportError:
        pass


def _root_attr(root: types.ModuleType, name: str):
    sub = _ROOT_NAMES.get(name)
    if sub is None:
        raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mlx_lm.{sub}"), name)
    setattr(root, name, value)
    return value


@functools.cache
def utils() -> types.ModuleType:
    """mlx-lm's ``utils.py`` (``load_model``, ``load_config``, ``_get_classes``) without
    transformers. Raises ImportError when its source is not what this expects."""
    tok = tokenizer_utils()
    # Names its removed imports bound, used in signatures (``load``'s return type) and by
    # functions that download: the compiled tokenizer module's, and the Hub's on first call.
    module = _compile("utils", {"TokenizerWrapper": tok.TokenizerWrapper,
                                "_load_tokenizer": tok.load,
                                "snapshot_download": _snapshot_download})
    if not all(hasattr(module, n) for n in ("load_model", "load_config", "_get_classes")):
        raise ImportError("mlx_lm.utils has no load_model/load_config/_get_classes")
    return module


@functools.cache
def tokenizer_utils() -> types.ModuleType:
    """mlx-lm's ``tokenizer_utils.py`` (``TokenizerWrapper``, ``_infer_tool_parser``…) without
    transformers. ``PreTrainedTokenizerBase`` is a stand-in: the wrapper only compares
    ``apply_chat_template`` with it, and finds ours custom (it is), with ``enable_thinking``."""

    class PreTrainedTokenizerBase:  # noqa: D401 - a stand-in, see above
        def apply_chat_template(self, *args, **kwargs):  # pragma: no cover - never called
            raise NotImplementedError

    module = _compile("tokenizer_utils", {"PreTrainedTokenizerBase": PreTrainedTokenizerBase})
    needed = ("TokenizerWrapper", "_infer_tool_parser", "StreamingDetokenizer")
    if not all(hasattr(module, n) for n in needed):
        raise ImportError(f"mlx_lm.tokenizer_utils has not all of {needed}")
    return module


def _snapshot_download(*args, **kwargs):
    from huggingface_hub import snapshot_download

    return snapshot_download(*args, **kwargs)


def _compile(name: str, extra: dict) -> types.ModuleType:
    install_root()
    root = sys.modules.get("mlx_lm")
    if root is None or not getattr(root, "__path__", None):
        raise ImportError("mlx_lm is not installed")
    path = Path(list(root.__path__)[0]) / f"{name}.py"
    code = _code(path, name)
    module = types.ModuleType(f"mlx_lm.{name}")
    module.__file__ = str(path)
    module.__package__ = "mlx_lm"  # its relative imports (``from .models…``) as usual
    module.__dict__.update(extra)
    try:
        exec(code, module.__dict__)  # noqa: S102 - mlx-lm's own code
    except Exception as err:  # noqa: BLE001 - whatever a changed source raises: slow path
        raise ImportError(f"cannot compile {path} without transformers: {err}") from None
    return module


def _code(path: Path, name: str) -> types.CodeType:
    """``path`` compiled without its heavy statements. Parsing costs ~0.1 s a start, so the
    code is kept (as Python keeps ``.pyc`` files) in ``paths.code_cache_dir()``, keyed by the
    source's path, size and modification time, Python's bytecode version and ``FILTER``, with
    a SHA-256 of its bytes: anything else is compiled again."""
    try:
        st = path.stat()
    except OSError as err:
        raise ImportError(f"cannot read {path}: {err}") from None
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{FILTER}|"
                         f"{importlib.util.MAGIC_NUMBER.hex()}".encode()).hexdigest()[:32]
    cached = code_cache_dir() / f"{name}-{key}.code"
    try:
        blob = cached.read_bytes()
        if hashlib.sha256(blob[32:]).digest() == blob[:32]:
            return marshal.loads(blob[32:])
    except (OSError, ValueError, EOFError, TypeError):
        pass  # missing or damaged: compiled again below
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
    except (OSError, SyntaxError, ValueError) as err:
        raise ImportError(f"cannot read {path}: {err}") from None
    tree.body = [node for node in tree.body if not _heavy(node)]
    code = compile(tree, str(path), "exec")
    payload = marshal.dumps(code)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(cached, hashlib.sha256(payload).digest() + payload)
    except OSError:
        pass  # (a read-only data folder: compiled again next time)
    return code


def _heavy(node: ast.stmt) -> bool:
    """A top-level statement that imports transformers/the Hub, or needs what they define."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False  # imports inside a function run only when it is called
    for sub in ast.walk(node):
        if isinstance(sub, ast.Import) and any(a.name.split(".")[0] in _HEAVY
                                               for a in sub.names):
            return True
        if isinstance(sub, ast.ImportFrom) and (sub.module or "").split(".")[0] in _HEAVY:
            return True
    if isinstance(node, ast.ClassDef):  # NewlineTokenizer(PreTrainedTokenizerFast)
        return any(isinstance(b, ast.Name) and b.id == "PreTrainedTokenizerFast"
                   for b in node.bases)
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):  # AutoTokenizer.register
        func = node.value.func
        return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
            func.value.id == "AutoTokenizer"
    return False


def load_model(path: Path, lazy: bool = True):
    """``mlx_lm.utils.load_model(path, lazy)`` (model, config) without transformers; the real
    one where the compiled copy cannot be made."""
    try:
        module = utils()
    except ImportError:
        module = importlib.import_module("mlx_lm.utils")
    return module.load_model(path, lazy=lazy)


def load_config(path: Path) -> dict:
    """``mlx_lm.utils.load_config(path)`` (config.json, with generation_config.json's EOS) without
    transformers; the real one where the compiled copy cannot be made."""
    try:
        module = utils()
    except ImportError:
        module = importlib.import_module("mlx_lm.utils")
    return module.load_config(path)


class Unquantized:
    """mlx-lm's ``load_model`` for a folder of MLX-quantized weights, up to (not including)
    its ``nn.quantize``: the model's modules built plain, the folder's tensors mapped lazily.
    For the CPU path, whose float32 copies of the quantized layers (``cpu/derived.py``) then
    take their place (``finish``): nothing is quantized only to be replaced, and the quantized
    tensors are never read.

    ``build`` returns None where this is not mlx-lm's plain path (no ``quantization`` in
    config.json, a model file of its own, quantized activations): the caller loads the usual
    way. What it is not: another model loader (classes, sanitizing and the strict weight check
    are mlx-lm's).
    """

    def __init__(self, model, config: dict, weights: dict, quantized: frozenset[str]):
        self.model, self.config, self.weights = model, config, weights
        self.quantized = quantized  # the layers mlx-lm would quantize: "{name}.scales" stored

    @classmethod
    def build(cls, path: Path) -> Unquantized | None:
        import glob

        import mlx.core as mx
        import mlx.nn as nn

        try:
            module = utils()
        except ImportError:
            return None
        config = module.load_config(path)
        if not isinstance(config.get("quantization"), dict) or "model_file" in config or \
                config.get("quantize_activations", False):
            return None
        weights = {}
        for wf in glob.glob(str(path / "model*.safetensors")):
            weights.update(mx.load(wf))
        model_class, args_class = module._get_classes(config=config)
        model = model_class(args_class.from_dict(config))
        if hasattr(model, "sanitize"):
            weights = model.sanitize(weights)
        quantized = frozenset(k[: -len(".scales")] for k in weights if k.endswith(".scales"))
        # Only layers the CPU path turns into plain ones (``backend.tune``): a quantized
        # layer of another kind (an MoE's switch layers) keeps mlx-lm's whole path.
        if not all(type(_child(model, name)) in (nn.Linear, nn.Embedding)
                   for name in quantized):
            return None
        return cls(model, config, weights, quantized)

    def finish(self, dense: dict) -> None:
        """Load ``dense`` (a float32 ``weight`` per quantized layer; biases become float32, as
        ``backend.tune`` makes them) and the folder's other tensors, lazily.

        Raises:
            ValueError: ``dense`` is not one weight of the right shape per quantized layer, or
                the folder's tensors are not what the model has (mlx-lm's strict check).
        """
        import mlx.core as mx

        if set(dense) != self.quantized:
            raise ValueError("the float32 weights are not the model's quantized layers")
        quant = (".weight", ".scales", ".biases")
        items = {k: v for k, v in self.weights.items()
                 if not (k.endswith(quant) and k.rsplit(".", 1)[0] in self.quantized)}
        for name, w in dense.items():
            items[f"{name}.weight"] = w
            if f"{name}.bias" in items:
                items[f"{name}.bias"] = items[f"{name}.bias"].astype(mx.float32)
        self.model.eval()
        self.model.load_weights(list(items.items()), strict=True)


def _child(module, dotted: str):
    """The submodule at ``dotted`` ("model.layers.3.mlp.up_proj"), or None."""
    node = module
    for part in dotted.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:  # (an nn.Module is a dict)
            node = node[part]
        else:
            return None
    return node
