"""Pieces shared by the ``agentspec`` CLI modules: errors and exit codes, the store, output.

Exit codes: 0 success, 1 failure (the store cannot be opened, a check failed), 2 usage or bad
input. Errors print one line on stderr, never a traceback. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import struct
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from agentspec.errors import AgentSpecError, ModelNotAvailableError, NotFoundError
from agentspec.terminal import output_width

# Exit codes, the same for every command (README, "The CLI"): 0 done, 1 failed, 2 bad input
# (usage, a value out of range, an unreadable file given), 3 not found (a record id, a scope,
# a model, a memory database that is not there).
EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
F = TypeVar("F", bound=Callable[..., Any])

# Every Typer app of the CLI: -h beside --help, and click's plain help layout (Typer's rich
# panels wrap docstrings mid-paragraph and give every flag a "<bool>" placeholder).
APP_SETTINGS: dict[str, Any] = {
    "rich_markup_mode": None, "add_completion": False, "pretty_exceptions_enable": False,
    "context_settings": {"help_option_names": ["-h", "--help"]},
}

# Rich lays a pipe's output out wide (agentspec.terminal: the bench's tables whole in a log).
console = Console(highlight=False, width=output_width(sys.stdout))
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


class CliError(Exception):
    """A failure reported as one line on stderr and exit code ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAIL) -> None:
        super().__init__(message)
        self.code = code


def fail(message: str, code: int = EXIT_FAIL) -> NoReturn:
    raise CliError(message, code)


def handles_errors(fn: F) -> F:
    """Turn CliError (its code), NotFoundError and ModelNotAvailableError (exit 3), any other
    AgentSpecError (exit 1) and ValueError (exit 2) into one-line errors."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CliError as e:
            code, message = e.code, str(e)
        except (NotFoundError, ModelNotAvailableError) as e:
            code, message = EXIT_NOT_FOUND, str(e)
        except AgentSpecError as e:
            code, message = EXIT_FAIL, str(e)
        except ValueError as e:
            code, message = EXIT_USAGE, str(e)
        except BrokenPipeError:  # `agentspec cache ls | head`
            raise typer.Exit(0) from None
        # one line: SQLAlchemy appends "(Background on this error at: ...)" on a second line
        first = message.strip().splitlines()[0] if message.strip() else type(fn).__name__
        err_console.print(f"error: {first}", markup=False, soft_wrap=True)
        if _json_asked(args, kwargs):  # --json means JSON on stdout, an error's too
            print_json({"error": first, "exit_code": code})
        raise typer.Exit(code)

    return wrapper  # type: ignore[return-value]


def _json_asked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the failed command was asked for --json (its context is among its arguments)."""
    ctx = kwargs.get("ctx") or next((a for a in args if hasattr(a, "find_root")), None)
    return ctx is not None and hasattr(ctx, "find_root") and options(ctx).json


@dataclass
class Options:
    """``--db`` and ``--json``, kept in the root ``ctx.obj``; the last one given wins."""

    db: str | None = None
    json: bool = False


def options(ctx: typer.Context) -> Options:
    root = ctx.find_root()
    if not isinstance(root.obj, Options):
        root.obj = Options()
    return root.obj


# The one definition of --db and --json. They are taken before the command (with the
# AGENTSPEC_DB fallback there only), after ``cache`` and after every cache subcommand.
DB_HELP = ("Memory database (SQLAlchemy URL); default AGENTSPEC_DB, else the SQLite file under "
           "AGENTSPEC_HOME. The last --db given wins.")


def db_option(**extra: Any) -> Any:
    return typer.Option("--db", metavar="URL", help=DB_HELP, **extra)


DbOpt = Annotated[str | None, db_option()]
JSON_FLAG = "--json"
JsonOpt = Annotated[bool, typer.Option(JSON_FLAG, help="Machine-readable JSON on stdout.")]


def set_options(ctx: typer.Context, db: str | None, json_out: bool) -> None:
    opts = options(ctx)
    if db is not None:
        opts.db = db
    opts.json = opts.json or json_out


def cache_command(fn: F) -> F:
    """A ``cache`` subcommand: one-line errors (:func:`handles_errors`) and the shared ``--db``
    and ``--json`` after it too; ``fn`` takes ``ctx`` and reads them with :func:`db_url`
    and :func:`want_json`."""
    handled = handles_errors(fn)
    sig = inspect.signature(fn, eval_str=True)
    if "ctx" not in sig.parameters:
        raise TypeError(f"{fn.__name__} needs a ctx: typer.Context parameter")

    @functools.wraps(fn)
    def wrapper(*args: Any, db: str | None = None, json_out: bool = False, **kwargs: Any) -> Any:
        set_options(kwargs["ctx"], db, json_out)
        return handled(*args, **kwargs)

    shared = [inspect.Parameter("db", inspect.Parameter.KEYWORD_ONLY, default=None,
                                annotation=DbOpt),
              inspect.Parameter("json_out", inspect.Parameter.KEYWORD_ONLY, default=False,
                                annotation=JsonOpt)]
    wrapper.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[*sig.parameters.values(), *shared])
    return wrapper  # type: ignore[return-value]


def db_url(ctx: typer.Context) -> str:
    from agentspec.home import default_db_url

    return options(ctx).db or default_db_url()


def fresh_home(ctx: typer.Context) -> bool:
    """Whether the memory is the default one under ``$AGENTSPEC_HOME`` and nothing was ever
    recorded there (no --db, no AGENTSPEC_DB, no database file yet)."""
    if options(ctx).db is not None:  # --db, or AGENTSPEC_DB through the root option
        return False
    path = sqlite_path(db_url(ctx))
    return path is not None and not path.exists()


def read_json_file(path: Path, option: str) -> Any:
    """The JSON value in the file ``option`` names; an unreadable or non-JSON file exits 2."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        fail(f"cannot read {option} file {str(path)!r}: {e.strerror}", EXIT_USAGE)
    except json.JSONDecodeError as e:
        fail(f"{option} file {str(path)!r} is not JSON: {e.msg} at line {e.lineno}", EXIT_USAGE)


def want_json(ctx: typer.Context) -> bool:
    return options(ctx).json


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL (None for other databases and in-memory SQLite)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError as e:
        fail(f"bad database URL {url!r}: {e}", EXIT_USAGE)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return None
    return None if database.startswith("file:") else Path(database)


# What a fresh home's read commands say beside their empty answer.
FRESH_HINT = ("nothing recorded yet: calls record their completions here "
              "(Speculator.from_pretrained, ChatAgentSpec.from_pretrained, agentspec generate)")


@contextmanager
def open_store(ctx: typer.Context, *, create: bool = False,
               fresh_empty: bool = False) -> Iterator[Any]:
    """The SQLStore of ``--db``; a missing SQLite file is an error unless ``create``, or, with
    ``fresh_empty`` on a fresh home (:func:`fresh_home`), an empty store and the hint on
    stderr: a listing of nothing recorded yet is empty, not an error."""
    from agentspec.stores.sql import SQLStore

    url = db_url(ctx)
    if fresh_empty and fresh_home(ctx):
        err_console.print(FRESH_HINT, markup=False)
        url = "sqlite://"
    path = sqlite_path(url)
    if path is not None and not create and not path.is_file():
        fail(f"no memory database at {path} (nothing recorded yet, or a wrong --db / "
             f"AGENTSPEC_DB)", EXIT_NOT_FOUND)
    store = SQLStore(url)
    try:
        yield store
    finally:
        store.close()


def load_speculator(model: str, url: str, config: Any = None, *, device: str | None = None,
                    dtype: str | None = None, quantize: str | None = None,
                    speculate: bool = True) -> Any:
    """The Speculator of ``model`` with its memory at ``url`` and ``config`` (a
    :class:`~agentspec.SpecConfig`), on ``device`` in ``dtype``, its weights quantized at load
    by ``quantize`` (None: the defaults of ``Speculator.from_pretrained``);
    ``speculate=False``: plain decoding, no memory. A model
    that is not there raises NotFoundError or ModelNotAvailableError: exit 3."""
    from agentspec.speculator import Speculator

    return Speculator.from_pretrained(model, memory=url if speculate else None, config=config,
                                      device=device, dtype=dtype, quantize=quantize,
                                      speculate=speculate)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")


def report(ctx: typer.Context, summary: dict[str, Any], text: str) -> None:
    """What a write command did: ``summary`` as JSON on stdout with ``--json``, else ``text``."""
    if want_json(ctx):
        print_json(summary)
    else:
        console.print(text, markup=False)


def stdin_is_tty() -> bool:
    return sys.stdin.isatty()


def confirm(question: str, yes: bool) -> None:
    """Ask on a terminal; without one, refuse (exit 2) unless ``--yes`` was given."""
    if yes:
        return
    if not stdin_is_tty():
        fail(f"not confirmed ({question}): stdin is not a terminal; pass --yes", EXIT_USAGE)
    if not typer.confirm(question, default=False):
        fail("aborted, nothing changed")


def progress() -> Progress:
    """A progress bar on stderr, shown only on a terminal."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), console=err_console, transient=True,
                    disable=not err_console.is_terminal)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")


def parse_duration(text: str) -> float:
    """Seconds in ``30s``, ``15m``, ``12h``, ``7d`` or ``2w``; CliError (exit 2) otherwise."""
    m = _DURATION.match(text)
    if m is None:
        fail(f"bad duration {text!r}: expected a number and a unit s, m, h, d or w "
             f"(30s, 15m, 12h, 7d, 2w)", EXIT_USAGE)
    return float(m.group(1)) * _UNITS[m.group(2)]


def age(t: float) -> str:
    """``3m ago``-style age of Unix time ``t``."""
    s = max(0.0, time.time() - t)
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit} ago"
    return f"{int(s)}s ago"


def short(text: str, n: int = 60) -> str:
    """``text`` on one line, cut to ``n`` characters."""
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 1] + "…"


# --- index files ---------------------------------------------------------------------------
def index_dir() -> Path:
    """Where CompletionMemory keeps its index files: ``$AGENTSPEC_HOME/index``."""
    from agentspec.home import agentspec_home

    return agentspec_home() / "index"


@dataclass(frozen=True)
class IndexFile:
    """One persisted faiss index of a (scope, embedder), read from its header and its .json."""

    path: Path
    scope: str
    embedder: str
    dim: int
    vectors: int  # -1 when the header cannot be read


def _header(path: Path) -> tuple[int, int]:
    """(dim, ntotal) from an ``IndexIDMap2`` file header, without importing faiss."""
    with open(path, "rb") as f:
        head = f.read(40)
    if len(head) < 40 or head[:4] != b"IxM2":
        return -1, -1
    dim, ntotal = struct.unpack_from("<iq", head, 4)
    return int(dim), int(ntotal)


def index_files(store_url: str, folder: Path | None = None) -> list[IndexFile]:
    """The index files under ``folder`` (default ``index_dir()``) built from ``store_url``."""
    folder = index_dir() if folder is None else folder
    out = []
    for meta_path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("store") != store_url:
                continue
            path = meta_path.with_suffix(".faiss")
            dim, vectors = _header(path) if path.is_file() else (-1, -1)
            out.append(IndexFile(path, str(meta["scope"]), str(meta["embedder"]), dim, vectors))
        except (OSError, ValueError, KeyError, AttributeError):
            continue  # not one of ours
    return out


def embedder_by_name(name: str) -> Any:
    """The embedder that wrote rows named ``name`` (``hash`` means ``hash-trigram-64``)."""
    from agentspec.memory.embedder import HashEmbedder, MiniLMEmbedder

    if name == MiniLMEmbedder.name:
        return MiniLMEmbedder()
    m = re.fullmatch(r"hash(?:-trigram-(\d+))?", name)
    if m:
        return HashEmbedder(int(m.group(1) or 64))
    fail(f"cannot embed with embedder {name!r}: known are {MiniLMEmbedder.name!r} and "
         f"'hash-trigram-N'", EXIT_USAGE)
