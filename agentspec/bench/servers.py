"""``agentspec bench --against llama.cpp``: agentspec serve beside the servers users run instead.

A CPU user runs llama.cpp's ``llama-server`` (directly, or under Ollama or LM Studio) on a GGUF
file; this bench runs ``agentspec serve`` and ``llama-server`` on the same file, with the same
threads and context budget, and sends both the same workload through the OpenAI chat API.

Systems (:data:`SYSTEMS`):

- ``agentspec``: ``agentspec serve`` with its memory; ``agentspec-plain``: ``serve
  --no-speculate`` (plain decoding on the same engine).
- ``llama.cpp``: ``llama-server --jinja`` (prompt caching on, its default), one slot per client
  of the highest level; ``llama.cpp-ngram-mod``, ``-ngram-simple``, ``-ngram-map-k``,
  ``-ngram-map-k4v``, ``-ngram-cache``: the same with its own n-gram speculation
  (``--spec-type``).
- ``vllm``, ``vllm-suffix``: ``vllm serve`` (plain, and Arctic Inference's suffix decoding)
  from vLLM's CPU build in ``.venv-vllm`` (``make test-vllm`` makes it), when it is there.

Each system is started and warmed alone, one after another, on the workload's warmup lines,
sent one at a time. agentspec records them into its memory, is restarted on the same memory
with ``--no-record`` (its measured passes record nothing) and is sent them again, so its KV
holds the warmup prompts as llama-server's slots do. The other servers keep what the warmup
left (llama.cpp its slots and prompt cache, vLLM its prefix cache and suffix tree).

Then at each level ``c`` (concurrency), ``c`` clients send the measured lines closed-loop: a
client sends its next line as soon as its last answer ends. At every level the systems take
turns, one pass each, the order rotated from level to level, so a slower minute of a shared
machine falls on each alike; only the system whose turn it is has traffic. Every call is
streamed and greedy (temperature 0).

Per system and level: tokens per second (completion tokens over the pass's wall time),
request latency and time to first token (p50/p99), tokens per step where the server says it,
and whether each answer equals that system's own answer at level 1; then how often the systems'
answers agree with each other. ``tools=True`` sends each line's tools as OpenAI ``tools`` with
``tool_choice: "required"`` and reports the share of answers that are valid calls of a bound
tool. A server that dies is reported with its exit code and log, and the others go on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentspec.bench.load import closed_loop
from agentspec.bench.openai_client import Answer, ServerGone, chat
from agentspec.bench.workload import WorkloadItem

LLAMA_NGRAM = ("ngram-mod", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache")
"""llama-server's own n-gram speculation types (``--spec-type``), a system each."""
SYSTEMS = ("agentspec", "agentspec-plain", "llama.cpp",
           *(f"llama.cpp-{t}" for t in LLAMA_NGRAM), "vllm", "vllm-suffix")
DEFAULT_SYSTEMS = ("agentspec", "llama.cpp")
VLLM_VENV = Path(".venv-vllm")
SERVED_NAME = "bench"
"""The model name every request gives (agentspec and vLLM are told to serve under it;
llama-server takes any)."""
Progress = Callable[[str, bool], None]
"""``(label, step)``: what is happening, and whether it is one unit of work (a server started
and warmed, a pass) done, for a progress bar."""


@dataclass(frozen=True)
class Launch:
    """How to start one system: ``command`` with ``{port}`` to fill; ``measure_command`` (if
    set) is the command it is restarted with after its first warmup (agentspec: recording
    off)."""

    name: str
    command: tuple[str, ...]
    measure_command: tuple[str, ...] | None = None
    env: tuple[tuple[str, str], ...] = ()
    start_seconds: float = 600.0


@dataclass(frozen=True)
class Setup:
    """What every system shares: the GGUF file, threads, a request's context budget, the
    highest level (the slots a server keeps), and where things live."""

    model: str
    gguf: Path
    threads: int
    context: int
    slots: int
    workdir: Path
    agentspec: tuple[str, ...] = (sys.executable, "-m", "agentspec.cli")
    llama_server: Path | None = None
    vllm_venv: Path = VLLM_VENV
    vllm_model: Path | None = None
    dtype: str | None = None  # agentspec serve's --dtype (None: its default)


def launch(name: str, setup: Setup) -> Launch:
    """The :class:`Launch` of system ``name``.

    Raises:
        ValueError: an unknown name.
        NotFoundError: its program is not there (the message says how to get it).
    """
    from agentspec.bench import llama_cpp
    from agentspec.errors import NotFoundError

    threads = (("OMP_NUM_THREADS", str(setup.threads)), ("MKL_NUM_THREADS", str(setup.threads)))
    if name in ("agentspec", "agentspec-plain"):
        db = f"sqlite:///{setup.workdir / (name + '.db')}"
        base = (*setup.agentspec, "serve", "--model", setup.model, "--port", "{port}",
                "--db", db, "--max-batch", str(setup.slots), "--log-level", "warning",
                "--served-model-name", SERVED_NAME)
        if setup.dtype is not None:
            base += ("--dtype", setup.dtype)
        if name == "agentspec-plain":
            return Launch(name, (*base, "--no-speculate"), env=threads)
        return Launch(name, base, (*base, "--no-record"), env=threads)
    if name.startswith("llama.cpp"):
        server = setup.llama_server or llama_cpp.binary("llama-server")
        command: tuple[str, ...] = (str(server), "-m", str(setup.gguf), "--port", "{port}", "--host", "127.0.0.1",
                   "-t", str(setup.threads), "-tb", str(setup.threads), "--jinja",
                   "--parallel", str(setup.slots), "-c", str(setup.context * setup.slots),
                   "--no-webui", "--log-disable")
        spec = name.removeprefix("llama.cpp").removeprefix("-")
        if spec:
            command += ("--spec-type", spec)
        return Launch(name, command)
    if name in ("vllm", "vllm-suffix"):
        vllm = setup.vllm_venv / "bin" / "vllm"
        if not vllm.is_file():
            raise NotFoundError(f"{name} needs vLLM's CPU build in {setup.vllm_venv} (make "
                                f"test-vllm builds it), not found: {vllm}")
        if setup.vllm_model is None:
            raise NotFoundError(f"{name} needs the model as a transformers folder")
        command = (str(vllm), "serve", str(setup.vllm_model), "--port", "{port}",
                   "--dtype", "float32", "--max-model-len", str(setup.context),
                   "--max-num-seqs", str(setup.slots), "--enforce-eager",
                   "--served-model-name", SERVED_NAME)
        if name == "vllm-suffix":
            command += ("--speculative-config",
                        json.dumps({"method": "suffix", "num_speculative_tokens": 8}))
        return Launch(name, command, env=(*threads, ("VLLM_CPU_OMP_THREADS_BIND", "all")),
                      start_seconds=900.0)
    raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    """A started server: its process, address and log."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def died(self) -> str | None:
        """Why it is gone (exit code and the log's tail), or None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        tail = self.log.read_bytes()[-1500:].decode(errors="replace") if self.log.is_file() else ""
        return f"{self.name} exited with code {code}; the end of its log ({self.log}):\n{tail}"

    def stop(self, grace: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start(spec: Launch, command: Sequence[str], log: Path) -> Running:
    """Start ``command`` and wait until its ``/health`` answers 200.

    Raises:
        ServerGone: it exited first, or did not answer within ``spec.start_seconds``.
    """
    port = free_port()
    argv = [part.replace("{port}", str(port)) for part in command]
    env = {**os.environ, **dict(spec.env)}
    with log.open("ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   stdin=subprocess.DEVNULL)
    server = Running(spec.name, process, port, log)
    deadline = time.monotonic() + spec.start_seconds
    while time.monotonic() < deadline:
        gone = server.died()
        if gone:
            raise ServerGone(f"{spec.name} did not start: {gone}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.5)
    server.stop(5)
    raise ServerGone(f"{spec.name} did not answer /health within {spec.start_seconds:.0f} s "
                     f"(log: {log})")


def request_body(item: WorkloadItem, *, tools: bool, model: str = SERVED_NAME) -> dict[str, Any]:
    """The chat request of a workload line: greedy, its own budget, every tool result given a
    ``tool_call_id`` (the workloads write calls as text); with ``tools``, its tools as OpenAI
    ``tools`` with ``tool_choice: "required"``.

    Raises:
        ValueError: the line is a raw prompt (this bench speaks the chat API).
    """
    if item.messages is None:
        raise ValueError(f"line {item.id!r} is a raw prompt; the servers bench sends chat "
                         f"messages only")
    messages = [dict(m) for m in item.messages]
    for i, m in enumerate(messages):  # a tool result names its call (OpenAI's API asks it)
        if m["role"] == "tool" and "tool_call_id" not in m:
            m["tool_call_id"] = f"call_{i}"
    body: dict[str, Any] = {"model": model, "messages": messages,
                            "max_tokens": item.max_new_tokens or 128, "temperature": 0.0,
                            "seed": 0}
    if tools:
        spec = item.grammar or {}
        bound = spec.get("tools") or []
        if not bound:
            raise ValueError(f"line {item.id!r} binds no tools; --tools needs lines with a "
                             f"tool_calls grammar")
        body["tools"] = [{"type": "function", "function": dict(t)} for t in bound]
        body["tool_choice"] = "required"
    return body


@dataclass(frozen=True)
class Call:
    """One answered line of a pass."""

    id: str
    answer: Answer


@dataclass
class Pass:
    """One system's run of the measured lines at one level."""

    system: str
    concurrency: int
    seconds: float
    calls: list[Call] = field(default_factory=list)


def run_pass(server: Running, items: Sequence[WorkloadItem], concurrency: int, *,
             tools: bool, timeout: float = 600.0) -> Pass:
    """``items`` through ``server`` by ``concurrency`` clients, closed loop.

    Raises:
        ServerGone: a call failed and the server is gone (its exit and log named).
    """
    def call(item: WorkloadItem) -> Call:
        return Call(item.id, chat(server.base_url, request_body(item, tools=tools),
                                  timeout=timeout))

    seconds, calls, error = closed_loop(items, concurrency, call, name="served-client")
    if error is not None:
        time.sleep(0.5)  # a dying process: let it exit so its code can be read
        gone = server.died()
        if gone:
            raise ServerGone(gone) from error
        raise error
    return Pass(server.name, concurrency, seconds, calls)


def warm(server: Running, items: Sequence[WorkloadItem], *, tools: bool) -> None:
    """The warmup lines, one at a time."""
    run_pass(server, items, 1, tools=tools)


def bring_up(spec: Launch, items: Sequence[WorkloadItem], *, tools: bool, logs: Path) -> Running:
    """Start ``spec`` and warm it (see the module docstring)."""
    log = logs / f"{spec.name}.log"
    server: Running | None = None
    for command in (spec.command, spec.measure_command):
        if command is None:
            break
        if server is not None:
            server.stop()
        server = start(spec, command, log)
        try:
            warm(server, items, tools=tools)
        except BaseException:
            server.stop(5)
            raise
    assert server is not None
    return server


def run(items_warmup: Sequence[WorkloadItem], items_measure: Sequence[WorkloadItem],
        launches: Sequence[Launch], levels: Sequence[int], *, tools: bool, logs: Path,
        on_progress: Progress | None = None) -> tuple[list[Pass], dict[str, str]]:
    """Every system warmed, then every level, the systems taking turns (module docstring).

    Returns:
        The passes, and for each system that failed, why (it is left out from then on).
    """
    say = on_progress or (lambda label, step: None)
    levels = sorted(set(levels) | {1})  # level 1 is every invariance check's reference
    up: dict[str, Running] = {}
    failed: dict[str, str] = {}
    passes: list[Pass] = []
    try:
        for spec in launches:
            say(f"{spec.name}: start and warm on {len(items_warmup)} lines", False)
            try:
                up[spec.name] = bring_up(spec, items_warmup, tools=tools, logs=logs)
                say(f"{spec.name}: warmed", True)
            except (ServerGone, RuntimeError) as e:
                failed[spec.name] = f"{type(e).__name__}: {e}"
                say(f"{spec.name} failed: {e}", False)
        for turn, level in enumerate(levels):
            names = [s.name for s in launches if s.name in up]
            shift = turn % len(names) if names else 0
            for name in names[shift:] + names[:shift]:
                try:
                    done = run_pass(up[name], items_measure, level, tools=tools)
                except (ServerGone, RuntimeError) as e:
                    failed[name] = f"at level {level}: {type(e).__name__}: {e}"
                    say(f"{name} failed at level {level}: {e}", False)
                    up.pop(name).stop(5)
                    continue
                passes.append(done)
                tokens = sum(c.answer.completion_tokens for c in done.calls)
                say(f"{name} at {level}: {tokens / max(done.seconds, 1e-9):.1f} tok/s", True)
    finally:
        for server in up.values():
            server.stop()
    return passes, failed


def system_setup(model: str, *, threads: int, context: int, levels: Sequence[int],
                 workdir: Path, names: Sequence[str], dtype: str | None = None) -> Setup:
    """The shared :class:`Setup` of ``model`` (a packaged name or a ``.gguf`` file); the
    transformers folder is made only for vLLM."""
    from agentspec.engine.load import gguf_file

    gguf = gguf_file(model)
    vllm_model = None
    if any(n.startswith("vllm") for n in names):
        from agentspec.engine.load import resolve_model_dir

        vllm_model = resolve_model_dir(model)[1]
    agentspec = shutil.which("agentspec")
    return Setup(model=model, gguf=gguf, threads=threads, context=context, slots=max(levels), workdir=workdir,
                 agentspec=(agentspec,) if agentspec else (sys.executable, "-m", "agentspec.cli"),
                 vllm_model=vllm_model, dtype=dtype)


def load_served_workload(name: str, default_max_new_tokens: int) -> Any:
    """A workload by file or shipped name, or ``humaneval`` (built from the installed HumanEval
    problems: code prompts whose answers agents repeat)."""
    from agentspec.bench.workload import Workload, load_workload, resolve_workload

    if name == "humaneval" and not Path(name).is_file():
        from agentspec.bench import humaneval

        items = humaneval.build_workload(humaneval.load_problems(), warmup=10, measure=16,
                                         max_new_tokens=default_max_new_tokens)
        return Workload(Path("humaneval"), tuple(items), ())
    return load_workload(resolve_workload(name), default_max_new_tokens=default_max_new_tokens)


def run_against(workload: Any, model: str, names: Sequence[str], levels: Sequence[int], *,
                tools: bool = False, threads: int | None = None, context: int = 4096,
                workdir: Path, on_progress: Progress | None = None,
                launches: Sequence[Launch] | None = None,
                dtype: str | None = None) -> dict[str, Any]:
    """The whole bench on a loaded ``workload`` (see the module docstring); returns the
    summary (:func:`agentspec.bench.servers_report.summarize`) with the run's settings.

    ``launches`` replaces the systems' own commands (the bench's tests start stub servers);
    ``dtype`` is agentspec serve's ``--dtype`` (``"gguf"``: the file's own weights).
    """
    from agentspec.bench.servers_report import summarize

    threads = threads or os.cpu_count() or 1
    levels = sorted(set(levels) | {1})
    measure, warmup = workload.measure, workload.warmup
    for item in (*warmup, *measure):
        request_body(item, tools=tools)  # a line the bench cannot send fails before any start
    setup = None
    if launches is None:
        setup = system_setup(model, threads=threads, context=context, levels=levels,
                             workdir=workdir, names=names, dtype=dtype)
        launches = [launch(n, setup) for n in names]
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    passes, failed = run(warmup, measure, launches, levels, tools=tools, logs=logs,
                         on_progress=on_progress)
    summary = summarize(passes, failed, measure, tools=tools)
    summary.update({"workload": str(workload.path), "model": model,
                    "gguf_name": setup.gguf.name if setup else model, "threads": threads,
                    "agentspec_dtype": dtype or "default",
                    "context": context, "levels": levels, "systems": [s.name for s in launches],
                    "requests": len(measure), "warmup": len(warmup),
                    "commands": {s.name: list(s.command) for s in launches}})
    return summary
