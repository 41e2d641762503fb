"""The house's rules, read from the code's own imports with ``ast``.

1. Arrows point down only: every module belongs to a layer (:data:`LAYERS`), and a module
   imports only from its own layer or lower ones. The core never imports ``adapters``,
   ``cli`` or ``bench``; the bench never imports the CLI.
2. No import circles, between modules (imports inside functions count: a lazy import is
   still an arrow; imports under ``if TYPE_CHECKING:`` do not, they never run).
3. Private names stay inside their module: no ``from x import _name``, no ``x._name`` on an
   imported module, no import of a module whose name starts with an underscore.
4. No module over :data:`MAX_LINES` lines.

Each rule is checked on the real tree and, in the same file, on a small tree written to
break it, so a checker that stopped seeing a broken rule fails here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folders and the package names they install as (pyproject's package-dir).
SOURCES = {"agentspec": "agentspec", "adapters": "agentspec.adapters", "stores": "agentspec.stores"}
MAX_LINES = 500

# Lowest first. A module belongs to the layer of its longest matching prefix (a name ending
# in "=" matches that module alone: the package's face).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("agentspec.types", "agentspec.errors", "agentspec.home", "agentspec.text",
     "agentspec.tree", "agentspec.terminal"),
    ("agentspec.grammar", "agentspec.stores"),
    ("agentspec.config", "agentspec.protocols"),
    ("agentspec.engine",),
    ("agentspec.memory", "agentspec.decoding"),
    ("agentspec.drafters",),
    ("agentspec.request", "agentspec.session", "agentspec.stream", "agentspec.scheduler",
     "agentspec.jobs",
     "agentspec.speculator", "agentspec.speculator_args", "agentspec="),
    ("agentspec.adapters", "agentspec.bench"),
    ("agentspec.cli",),
)


@dataclass(frozen=True)
class Arrow:
    """``source`` imports ``target`` (both module names) at ``line``; ``names``: what it takes."""

    source: str
    target: str
    line: int
    names: tuple[str, ...]
    typing_only: bool


def modules(root: Path, sources: dict[str, str]) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under the source folders."""
    out = {}
    for folder, package in sources.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _typing_only_lines(tree: ast.Module) -> set[int]:
    """Lines of the statements under ``if TYPE_CHECKING:``."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def arrows(name: str, path: Path, known: set[str]) -> Iterator[Arrow]:
    """Every import of a module in ``known`` made by module ``name`` (file ``path``)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = _typing_only_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield Arrow(name, alias.name, node.lineno, (), node.lineno in typing_only)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module not in known:
                continue
            plain = []
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if sub in known:  # ``from package import module``
                    yield Arrow(name, sub, node.lineno, (), node.lineno in typing_only)
                else:
                    plain.append(alias.name)
            if plain:
                yield Arrow(name, module, node.lineno, tuple(plain), node.lineno in typing_only)


def layer_of(module: str) -> int | None:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            exact = prefix.endswith("=")
            prefix = prefix.rstrip("=")
            if (module == prefix or (not exact and module.startswith(prefix + "."))) \
                    and len(prefix) > best:
                best, rank = len(prefix), i
    return rank


def upward_arrows(found: list[Arrow]) -> list[str]:
    out = []
    for a in found:
        src, dst = layer_of(a.source), layer_of(a.target)
        if src is None or dst is None:
            continue  # reported by unplaced_modules
        if dst > src:
            out.append(f"{a.source} (layer {src}) imports {a.target} (layer {dst}), line {a.line}")
    return out


def unplaced_modules(names: list[str]) -> list[str]:
    return [m for m in names if layer_of(m) is None]


def circles(found: list[Arrow]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), typing-only arrows left out."""
    graph: dict[str, set[str]] = {}
    for a in found:
        if not a.typing_only and a.source != a.target:
            graph.setdefault(a.source, set()).add(a.target)
            graph.setdefault(a.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def private_reaches(name: str, path: Path, known: set[str]) -> list[str]:
    """Another module's private names that module ``name`` takes."""
    out = []
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}  # local name -> imported agentspec module
    for a in arrows(name, path, known):
        if any(_private(p) for p in a.target.split(".")):
            out.append(f"{name} imports the private module {a.target}, line {a.line}")
        if a.target != name:
            out += [f"{name} imports {a.target}.{n}, line {a.line}"
                    for n in a.names if _private(n)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in known:
                    aliases[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) \
                and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and aliases[node.value.id] != name:
            out.append(f"{name} reads {aliases[node.value.id]}.{node.attr}, line {node.lineno}")
    return out


def too_long(files: dict[str, Path]) -> list[str]:
    out = []
    for name, path in files.items():
        count = len(path.read_text().splitlines())
        if count > MAX_LINES:
            out.append(f"{name}: {count} lines")
    return out


def check(root: Path, sources: dict[str, str]) -> dict[str, list]:
    files = modules(root, sources)
    known = set(files)
    found = [a for name, path in files.items() for a in arrows(name, path, known)]
    return {
        "unplaced": unplaced_modules(sorted(files)),
        "upward": upward_arrows(found),
        "circles": circles(found),
        "private": [r for name, path in files.items() for r in private_reaches(name, path, known)],
        "too long": too_long(files),
    }


@pytest.fixture(scope="module")
def house() -> dict[str, list]:
    return check(ROOT, SOURCES)


@pytest.mark.parametrize("rule", ["unplaced", "upward", "circles", "private", "too long"])
def test_the_house_keeps_its_rules(house: dict[str, list], rule: str) -> None:
    assert house[rule] == [], f"{rule}: " + "\n".join(map(str, house[rule]))


def test_the_rules_see_every_module() -> None:
    files = modules(ROOT, SOURCES)
    assert "agentspec.engine.target" in files and "agentspec.stores.sql" in files
    assert "agentspec.adapters.langchain" in files and "agentspec.bench.harness" in files
    known = set(files)
    found = list(arrows("agentspec.speculator", files["agentspec.speculator"], known))
    assert any(a.target == "agentspec.decoding.loop" for a in found)


# -- a tree built to break every rule: the checker must see each break ---------------------

BROKEN = {
    "agentspec/__init__.py": "",
    "agentspec/types.py": "from agentspec.cli import main\n",  # upward: the core imports the CLI
    "agentspec/tree.py": "def helper():\n    from agentspec import text\n",
    "agentspec/text.py": "import agentspec.tree\n",  # with tree.py: a circle through a lazy import
    "agentspec/errors.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                           "    from agentspec.home import X\n",
    "agentspec/home.py": "from agentspec.errors import E\n",  # typing-only arrow back: no circle
    "agentspec/engine/__init__.py": "",
    "agentspec/engine/target.py": "from agentspec.engine.kv import _ATTENTION\n"
                                  "from agentspec.engine import kv as k\nx = k._gqa\n",
    "agentspec/engine/kv.py": "_ATTENTION = 1\n_gqa = 2\n",
    "agentspec/engine/_fixed.py": "",
    "agentspec/engine/load.py": "from agentspec.engine import _fixed\n" + "x = 1\n" * MAX_LINES,
    "agentspec/cli/__init__.py": "from agentspec.bench import harness\n",
    "agentspec/bench/__init__.py": "",
    "agentspec/bench/harness.py": "from agentspec.cli import main\n",  # upward and a circle
    "agentspec/newroom.py": "",
}


def test_a_broken_tree_fails_every_rule(tmp_path: Path) -> None:
    for rel, text in BROKEN.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    found = check(tmp_path, {"agentspec": "agentspec"})
    assert found["unplaced"] == ["agentspec.newroom"]
    assert any(r.startswith("agentspec.types (layer 0) imports agentspec.cli")
               for r in found["upward"])
    assert any(r.startswith("agentspec.bench.harness (layer 7) imports agentspec.cli")
               for r in found["upward"])
    assert ["agentspec.text", "agentspec.tree"] in found["circles"]
    assert ["agentspec.bench.harness", "agentspec.cli"] in found["circles"]
    assert not any("agentspec.errors" in group for group in found["circles"])
    private = "\n".join(found["private"])
    assert "imports agentspec.engine.kv._ATTENTION" in private
    assert "reads agentspec.engine.kv._gqa" in private
    assert "imports the private module agentspec.engine._fixed" in private
    assert found["too long"] == [f"agentspec.engine.load: {MAX_LINES + 1} lines"]
