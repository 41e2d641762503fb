"""No module of the library's core, adapters or stores over :data:`MAX_LINES` lines.

Issue 55's figure: a module that outgrows it is split by responsibility (not trimmed). The
bench (``agentspec/bench``) and the CLI (``agentspec/cli``) are left out; the house-wide
ceiling for every module is ``tests/test_layering.py``'s. The checker is shown, in the same
file, to flag a file one line over.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 450
# Source folders checked, and the folders under them left out.
FOLDERS = ("agentspec", "adapters", "stores")
EXCLUDED = ("agentspec/bench", "agentspec/cli")


def too_long(root: Path, folders: tuple[str, ...] = FOLDERS,
             excluded: tuple[str, ...] = EXCLUDED, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """``(path relative to root, lines)`` of every ``.py`` file under ``folders`` (but not
    under ``excluded``) longer than ``limit`` lines, in path order."""
    skip = [root / e for e in excluded]
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            if any(path.is_relative_to(s) for s in skip):
                continue
            count = len(path.read_text().splitlines())
            if count > limit:
                out.append((path.relative_to(root).as_posix(), count))
    return out


def report(offenders: list[tuple[str, int]]) -> str:
    return f"modules over {MAX_LINES} lines:\n" + "\n".join(
        f"  {path}: {count} lines" for path, count in offenders)


def test_no_module_of_the_core_adapters_or_stores_is_over_the_limit() -> None:
    offenders = too_long(ROOT)
    assert offenders == [], report(offenders)


def test_the_checker_flags_a_file_one_line_over_and_only_there(tmp_path: Path) -> None:
    files = {
        "agentspec/long.py": MAX_LINES + 1,
        "agentspec/full.py": MAX_LINES,  # at the limit: allowed
        "agentspec/engine/deep.py": MAX_LINES + 1,  # nested folders are seen
        "agentspec/bench/harness.py": MAX_LINES + 1,  # left out
        "agentspec/cli/main.py": MAX_LINES + 1,  # left out
        "stores/sql.py": MAX_LINES + 1,
        "adapters/ok.py": 3,
        "docs/notes.py": MAX_LINES + 1,  # not a checked folder
    }
    for rel, lines in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n" * lines)
    offenders = too_long(tmp_path)
    assert offenders == [("agentspec/engine/deep.py", MAX_LINES + 1),
                         ("agentspec/long.py", MAX_LINES + 1),
                         ("stores/sql.py", MAX_LINES + 1)]
    assert f"agentspec/long.py: {MAX_LINES + 1} lines" in report(offenders)
