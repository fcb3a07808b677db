"""The package's layers import in one direction: no cycles, lazy imports included; a layer
imports only its own and those below it; no module uses another module's ``_private`` names;
only the front ends import Textual."""

import ast
import fnmatch
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "localchat"


def module_name(path: Path) -> str:
    parts = path.with_suffix("").parts
    parts = parts[len(parts) - 1 - parts[::-1].index("localchat"):]  # from the package on
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """localchat modules ``path`` imports anywhere in its body (functions included)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("localchat"):
                for alias in node.names:  # `from . import paths` names a module
                    sub = f"{target}.{alias.name}"
                    root = path.parents[len(here.split(".")) - 1 + (path.name == "__init__.py")]
                    where = root / sub.replace(".", "/")
                    module = where.with_suffix(".py").exists() or (where / "__init__.py").exists()
                    found.add(sub if module else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("localchat")}
    return found - {here}


def test_no_import_cycles():
    graph = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    cycles = []

    def visit(node, stack, done):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in done:
            return
        done.add(node)
        for nxt in graph.get(node, ()):
            visit(nxt, stack + [node], done)

    done: set[str] = set()
    for name in graph:
        visit(name, [], done)
    assert cycles == []


# Lowest first: the folders are the layers. A module may import modules of its own layer and
# of the layers below; ``localchat.cluster`` is split: its group, control link and split are
# what the model layer drives, its launcher and follower are front ends.
LAYERS = {
    "base": ["localchat", "localchat.errors", "localchat.paths", "localchat.files",
             "localchat.fmt", "localchat.locks", "localchat.events", "localchat.crashlog"],
    "stores and the machine": ["localchat.store", "localchat.store.*", "localchat.kvcache",
                               "localchat.kvcache.*", "localchat.cpu", "localchat.cpu.*",
                               "localchat.cluster", "localchat.cluster.group",
                               "localchat.cluster.control", "localchat.cluster.split"],
    "model": ["localchat.model", "localchat.model.*"],
    "session": ["localchat.session", "localchat.session.*", "localchat.cacheview",
                "localchat.cacheview.*", "localchat.tools", "localchat.tools.*"],
    "front ends": ["localchat.__main__", "localchat.cli", "localchat.cli.*", "localchat.tui",
                   "localchat.tui.*", "localchat.server", "localchat.server.*",
                   "localchat.resident", "localchat.resident.*",
                   "localchat.cluster.launch", "localchat.cluster.follower"],
}


def layer_of(module: str) -> int:
    for rank, patterns in enumerate(LAYERS.values()):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def upward_imports(package: Path) -> list[str]:
    """'a -> b' for every import of a higher layer, in the package at ``package``."""
    names = list(LAYERS)
    wrong = []
    for path in sorted(package.rglob("*.py")):
        here = module_name(path)
        for target in sorted(imports_of(path)):
            if layer_of(target) > layer_of(here):
                wrong.append(f"{here} ({names[layer_of(here)]}) -> {target} "
                             f"({names[layer_of(target)]})")
    return wrong


def private_uses(path: Path) -> list[str]:
    """Where ``path`` takes a ``_name`` from another localchat module: ``from x import _n``,
    or ``module._n`` on a module it imported."""
    here = module_name(path)
    tree = ast.parse(path.read_text())
    modules: set[str] = set()  # local names bound to localchat modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                "localchat")):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{here}: from {'.' * node.level}{node.module or ''} import "
                                 f"{alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("localchat"):
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append(f"{here}: {node.value.id}.{node.attr}")
    return found


def test_layers_import_downward_only():
    assert upward_imports(PACKAGE) == []


def test_no_module_uses_another_modules_private_names():
    assert [u for p in sorted(PACKAGE.rglob("*.py")) for u in private_uses(p)] == []


def test_only_the_front_ends_import_textual():
    for path in PACKAGE.rglob("*.py"):
        here = module_name(path)
        tree = ast.parse(path.read_text())
        textual = any(
            (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "textual")
            or (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "textual"
                                                  for a in n.names))
            for n in ast.walk(tree))
        assert not textual or here.startswith("localchat.tui"), here


@pytest.mark.parametrize("violation", ["upward", "upward by name", "private"])
def test_negative_controls_the_checks_see_a_violation(tmp_path, violation):
    """A copy of the package with one deliberate violation fails the check."""
    import shutil

    copy = tmp_path / "localchat"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "kvcache" / "kinds.py"
    line = {"upward": "\nfrom ..session.session import Session  # noqa\n",
            "upward by name": "\nfrom ..session import session  # noqa\n",
            "private": "\nfrom ..session.turncache import _private_thing  # noqa\n"}[violation]
    target.write_text(target.read_text() + line)
    if violation.startswith("upward"):
        assert upward_imports(copy) == [
            "localchat.kvcache.kinds (stores and the machine) -> localchat.session.session "
            "(session)"]
    else:
        assert private_uses(target) == [
            "localchat.kvcache.kinds: from ..session.turncache import _private_thing"]
