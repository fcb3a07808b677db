"""The package's layers import in one direction: no cycles, lazy imports included."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "localchat"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
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
                    found.add(sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists()
                              else target)
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
