"""The engine's one path, read from the code with ``ast``.

1. No class of ``agentspec/engine/`` has more than :data:`MAX_METHODS` methods (properties
   count): a room with one door, not a second staircase.
2. One prefill loop: a prompt chunk (a member whose logits are not wanted) is cut in one
   place only, :meth:`Prefill.chunk <agentspec.engine.plan.Prefill.chunk>`.
3. One commit site per sequence: a sequence's committed tokens grow in one method only,
   :meth:`Sequence.commit <agentspec.engine.sequence.Sequence.commit>`, and no module outside
   ``engine/sequence.py`` writes them.
4. One engine entry in the scheduler: it hops to the torch thread in one method, runs its
   step only from there, runs a forward in one place, and hands the engine over in one
   method.
5. Nothing outside the engine reaches into the engine's private fields.

Each rule is checked on the real tree and, in the same file, on a small source written to
break it, so a checker that stopped seeing a broken rule fails here.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "agentspec" / "engine"
SOURCES = [ROOT / "agentspec", ROOT / "adapters", ROOT / "stores"]
MAX_METHODS = 20


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _files(folders: list[Path]) -> list[Path]:
    return sorted(p for folder in folders for p in folder.rglob("*.py"))


def _functions(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """Every function with its qualified name (``Class.method`` or ``function``)."""
    out: list[tuple[str, ast.AST]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return out


# -- 1. methods per class -------------------------------------------------------------------

def crowded_classes(tree: ast.Module, limit: int = MAX_METHODS) -> dict[str, int]:
    """Classes with more than ``limit`` methods."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
            if n > limit:
                out[node.name] = n
    return out


def test_no_engine_class_has_more_than_twenty_methods() -> None:
    crowded = {f"{p.relative_to(ROOT)}:{name}": n for p in _files([ENGINE])
               for name, n in crowded_classes(_parse(p)).items()}
    assert not crowded, f"classes over {MAX_METHODS} methods: {crowded}"


def test_the_method_count_sees_a_crowded_class() -> None:
    body = "\n".join(f"    def m{i}(self): pass" for i in range(MAX_METHODS + 1))
    assert crowded_classes(ast.parse(f"class Big:\n{body}\n")) == {"Big": MAX_METHODS + 1}
    assert crowded_classes(ast.parse("class Small:\n    def m(self): pass\n")) == {}


# -- 2. one prefill loop --------------------------------------------------------------------

def chunk_makers(tree: ast.Module) -> list[str]:
    """Functions that build a member whose logits are not wanted (a prompt chunk)."""
    out = []
    for name, fn in _functions(tree):
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Member" \
                    and any(k.arg == "logits" and isinstance(k.value, ast.Constant) and k.value.value is False
                            for k in node.keywords):
                out.append(name)
    return out


def test_prompt_chunks_are_cut_in_one_place() -> None:
    makers = [f"{p.relative_to(ROOT)}:{name}" for p in _files(SOURCES)
              for name in chunk_makers(_parse(p))]
    assert makers == ["agentspec/engine/plan.py:Prefill.chunk"], makers


def test_the_chunk_check_sees_a_second_prefill_loop() -> None:
    source = ("def prefill(seq, ids):\n"
              "    for b in range(0, len(ids), 64):\n"
              "        run([Member(seq, ids[b:b + 64], [], None, logits=False)])\n")
    assert chunk_makers(ast.parse(source)) == ["prefill"]


# -- 3. one commit site ---------------------------------------------------------------------

_GROWS = {"extend", "append", "insert", "__iadd__"}


def _a_sequence(node: ast.expr) -> bool:
    """Whether ``node`` names a sequence (``seq``, ``job.seq``, ``self._seq``...)."""
    text = ast.unparse(node)
    return text.split(".")[-1].lstrip("_") in ("seq", "sequence")


def ids_writers(tree: ast.Module, owner: Callable[[ast.expr], bool] = lambda _: True) -> list[str]:
    """Functions that write an ``owner``'s ``.ids`` list in place or assign one
    (``x.ids = ...``)."""
    out = []
    for name, fn in _functions(tree):
        for node in ast.walk(fn):
            grows = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                     and node.func.attr in _GROWS and isinstance(node.func.value, ast.Attribute)
                     and node.func.value.attr == "ids" and owner(node.func.value.value))
            targets: list[ast.expr] = (node.targets if isinstance(node, ast.Assign) else
                                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                                       else [])
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            assigns = any(isinstance(t, ast.Attribute) and t.attr == "ids" and owner(t.value)
                          for t in flat)
            if grows or assigns:
                out.append(name)
    return sorted(set(out))


def test_a_sequence_commits_in_one_place() -> None:
    sequence = ENGINE / "sequence.py"
    inside = ids_writers(_parse(sequence))
    # commit grows them; a new generation holds a prefix, release and __init__ empty them
    assert inside == ["Sequence.__init__", "Sequence.commit", "Sequence.release", "Sequence.start"]
    grows = [name for name, fn in _functions(_parse(sequence)) for node in ast.walk(fn)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr in _GROWS and getattr(node.func.value, "attr", "") == "ids"]
    assert grows == ["Sequence.commit"]
    outside = [f"{p.relative_to(ROOT)}:{name}" for p in _files(SOURCES) if p != sequence
               for name in ids_writers(_parse(p), _a_sequence)]
    assert outside == [], f"committed tokens written outside Sequence: {outside}"


def test_the_commit_check_sees_a_second_writer() -> None:
    source = "def bench(target):\n    target.seq.ids = [7] * 100\n"
    assert ids_writers(ast.parse(source), _a_sequence) == ["bench"]
    assert ids_writers(ast.parse("def f(seq):\n    seq.ids.extend([1])\n")) == ["f"]
    assert ids_writers(ast.parse("def g(seq):\n    seq.table, seq.ids = [], [1]\n")) == ["g"]


# -- 4. one engine entry in the scheduler ---------------------------------------------------

def engine_entries(tree: ast.Module) -> dict[str, list[str]]:
    """Where the scheduler hops to the torch thread (``for_device``), runs its step
    (``self._step``), runs a forward (``.target.run``), and takes the engine
    (``self._running = True``)."""
    out: dict[str, list[str]] = {"hop": [], "step": [], "forward": [], "hand-off": []}
    for name, fn in _functions(tree):
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "for_device":
                out["hop"].append(name)
            if isinstance(node, ast.Attribute) and node.attr == "_step" and name != "Scheduler._step":
                out["step"].append(name)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "run" and ast.unparse(node.func.value) == "self.target":
                out["forward"].append(name)
            if isinstance(node, ast.Assign) and any(ast.unparse(t) == "self._running" for t in node.targets) \
                    and isinstance(node.value, ast.Constant) and node.value.value is True:
                out["hand-off"].append(name)
    return out


def test_the_scheduler_enters_the_engine_in_one_place() -> None:
    entries = engine_entries(_parse(ROOT / "agentspec" / "scheduler.py"))
    assert entries == {"hop": ["Scheduler._engine_step"], "step": ["Scheduler._engine_step"],
                       "forward": ["Scheduler._forward"], "hand-off": ["Scheduler._take_engine"]}


def test_the_entry_check_sees_a_second_door() -> None:
    source = ("class Scheduler:\n"
              "    def next(self):\n"
              "        self._running = True\n"
              "        for_device(self.target.device, self._step)\n"
              "    def close(self):\n"
              "        self._running = True\n"
              "        for_device(self.target.device, self._step)\n")
    entries = engine_entries(ast.parse(source))
    assert entries["hop"] == ["Scheduler.next", "Scheduler.close"]
    assert entries["hand-off"] == ["Scheduler.next", "Scheduler.close"]


# -- 5. the engine's fields stay the engine's -----------------------------------------------

_ENGINE_PARTS = {"forward", "pool", "seq", "trie", "fused"}


def private_reaches(tree: ast.Module) -> list[str]:
    """``x.part._name`` where ``part`` is one of the engine's parts: a private field of the
    engine reached from outside it."""
    return sorted({ast.unparse(node) for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and node.attr.startswith("_")
                   and not node.attr.startswith("__")
                   and isinstance(node.value, ast.Attribute) and node.value.attr in _ENGINE_PARTS})


def test_nothing_outside_the_engine_reaches_into_it() -> None:
    reaches = {f"{p.relative_to(ROOT)}": private_reaches(_parse(p)) for p in _files(SOURCES)
               if ENGINE not in p.parents}
    assert not {k: v for k, v in reaches.items() if v}


def test_the_reach_check_sees_a_private_field() -> None:
    assert private_reaches(ast.parse("target.forward._modules(layout, False)")) == [
        "target.forward._modules"]
