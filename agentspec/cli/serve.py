"""``agentspec serve``: one model behind an OpenAI-compatible HTTP API.

Loads the model and its completion memory (``--db``, as the other commands), warms it up,
then serves :mod:`agentspec.adapters.openai_server` with uvicorn until interrupted. The web
stack is imported only here, when the command runs, so the rest of the CLI stays light; the
options map one to one onto :class:`~agentspec.adapters.openai_server.ServerConfig`.
"""

from __future__ import annotations

import gc
import socket
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from agentspec.cli.common import (
    EXIT_USAGE,
    DbOpt,
    db_url,
    fail,
    handles_errors,
    load_speculator,
    read_json_file,
    set_options,
)

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@handles_errors
def serve(ctx: typer.Context,
          model: Annotated[str, typer.Option(
              "--model", help="Packaged name, model folder, .gguf file or hub id (org/name).")] = "smollm2-135m-instruct",
          device: Annotated[str | None, typer.Option(
              "--device", help="Where the model runs: cpu, cuda or cuda:N. Default: cuda when "
                               "torch sees a GPU, else cpu.")] = None,
          dtype: Annotated[str | None, typer.Option(
              "--dtype", help="The model's weights: float32 (fp32), bfloat16 (bf16: on the "
                              "CPU a Llama, Mistral or Qwen model's held in bf16 for the native "
                              "forward), float16 (fp16), or gguf: a GGUF model's weights as the "
                              "file stores them (CPU or CUDA). Default: bfloat16 on CUDA; on the CPU "
                              "gguf for a GGUF that loads so (the packaged models), else "
                              "float32.")] = None,
          quantize: Annotated[str | None, typer.Option(
              "--quantize", help="Quantize a transformers model's weights at load: int8 or "
                                 "int4 (per 32 weights, as GGUF's Q8_0 and Q4_1), held and "
                                 "run as a GGUF's are (CPU). Not for a GGUF model: it takes "
                                 "--dtype gguf.")] = None,
          host: Annotated[str, typer.Option(
              "--host", help="Address to bind; the default serves this machine only.")] = "127.0.0.1",
          port: Annotated[int, typer.Option(
              "--port", min=0, max=65535, help="Port to bind; 0 picks a free one (printed).")] = 8000,
          api_key: Annotated[str | None, typer.Option(
              "--api-key", envvar="AGENTSPEC_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' (any allowed scope).")] = None,
          keys: Annotated[Path | None, typer.Option(
              "--keys", metavar="FILE",
              help='A JSON file of API keys and their scopes: {"KEY": "scope" | ["scope", ...]}; '
                   "a key may use only its scopes, the first by default.")] = None,
          scope: Annotated[str, typer.Option(
              "--scope", help="Memory scope of a request that names none (no "
                              "X-Agentspec-Scope header, no 'user').")] = "default",
          allow_scope: Annotated[list[str] | None, typer.Option(
              "--allow-scope", help="Allow only this scope (repeatable; --scope must be one); "
                                    "default: any.")] = None,
          max_tokens: Annotated[int, typer.Option(
              "--max-tokens", min=1, help="Most tokens a request may ask for; also the "
                                          "default.")] = 1024,
          max_body_bytes: Annotated[int, typer.Option(
              "--max-body-bytes", min=1, help="Largest request body (413 above).")] = 1 << 20,
          served_name: Annotated[str | None, typer.Option(
              "--served-model-name", help="The name requests give as 'model'; default "
                                          "--model.")] = None,
          max_batch: Annotated[int, typer.Option(
              "--max-batch", min=1, help="Requests stepped at once, their rows in the same "
                                         "forwards; more wait, first come first served.")] = 16,
          workers: Annotated[int | None, typer.Option(
              "--workers", min=1, help="Threads carrying requests (each running one holds "
                                       "one); more requests wait for a thread. Default twice "
                                       "--max-batch.")] = None,
          tool_format: Annotated[str | None, typer.Option(
              "--tool-format", help="How the model writes tool calls: json, hermes, llama3, "
                                    "mistral, mistral_v11, phi or granite; default: the format its chat "
                                    "template teaches (json when it renders no tools).")] = None,
          no_record: Annotated[bool, typer.Option(
              "--no-record", help="Draft from the memory but add nothing to it.")] = False,
          no_speculate: Annotated[bool, typer.Option(
              "--no-speculate", help="Plain decoding on the same engine: no drafts, no memory "
                                     "(a baseline; outputs are the same).")] = False,
          max_queue: Annotated[int | None, typer.Option(
              "--max-queue", min=0, help="Requests that may wait beyond --max-batch; one more "
                                         "gets a 429 with Retry-After. Default: no bound.")] = None,
          request_timeout: Annotated[float | None, typer.Option(
              "--request-timeout", metavar="S",
              help="Seconds a generation request may run from its admission; past it, it "
                   "stops with a 504 (a stream: an error event, then [DONE]). Default: no "
                   "limit.")] = None,
          grace: Annotated[float, typer.Option(
              "--grace", metavar="S", help="After SIGTERM (new requests get a 503, /ready "
                                           "says 503), seconds the requests in flight get to "
                                           "finish before they are stopped.")] = 20.0,
          metrics_public: Annotated[bool, typer.Option(
              "--metrics-public", help="Serve GET /metrics without an API key (by default it "
                                       "needs one, as the API does).")] = False,
          metrics_scopes: Annotated[bool, typer.Option(
              "--metrics-scopes", help="Label the request and token metrics with the memory "
                                       "scope (a series per tenant).")] = False,
          log_level: Annotated[str, typer.Option(
              "--log-level", help=f"Server log level: {', '.join(_LOG_LEVELS)}.")] = "info",
          db: DbOpt = None) -> None:
    """Serve a model over an OpenAI-compatible HTTP API: POST /v1/chat/completions (streaming,
    tools, JSON schemas, logprobs), POST /v1/completions (raw prompts), GET /v1/models, GET
    /health (alive), GET /ready (taking requests), GET /metrics (Prometheus). Runs until
    SIGTERM or Ctrl-C: new requests then get a 503, the ones in flight get --grace seconds,
    the memory's writes are flushed, and it exits 0.

    A request's memory scope is its X-Agentspec-Scope header, else its 'user' field, else
    its key's first scope, else --scope. Outputs equal Speculator.generate on the same
    rendered prompt and sampling.

    Example: agentspec serve --port 8000 --api-key s3cret
    """
    set_options(ctx, db, False)
    if log_level not in _LOG_LEVELS:
        fail(f"--log-level must be one of {', '.join(_LOG_LEVELS)}, got {log_level!r}", EXIT_USAGE)
    device, dtype = _placement(device, dtype)
    _check_quantize(model, device, dtype, quantize)
    try:
        from agentspec.adapters.lifecycle import (
            ServiceConfig,
            check_memory,
            serve_until_stopped,
            shut_down,
        )
        from agentspec.adapters.openai_server import OpenAIServer, ServerConfig
    except ImportError as e:
        fail(f"agentspec serve needs the server extra: pip install 'agentspec-llm[serve]' ({e})")
    key_scopes = _read_keys(keys) if keys is not None else {}
    config = ServerConfig(  # bad values raise ValueError: exit 2, before the model loads
        models=(served_name or model,), max_tokens=max_tokens, max_body_bytes=max_body_bytes,
        api_keys=frozenset([api_key] if api_key else []), key_scopes=key_scopes,
        scopes=frozenset(allow_scope) if allow_scope else None, default_scope=scope,
        record=False if no_record else None, workers=workers or 2 * max_batch,
        tool_format=tool_format)
    service = ServiceConfig(max_queue=max_queue, request_timeout=request_timeout, grace=grace,
                            metrics_public=metrics_public, metrics_scopes=metrics_scopes)
    from agentspec.config import SpecConfig

    sock = _bind(host, port)
    started = time.perf_counter()
    spec = load_speculator(model, db_url(ctx), SpecConfig(max_batch=max_batch), device=device,
                           dtype=dtype, quantize=quantize, speculate=not no_speculate)
    loaded = time.perf_counter()
    spec.warmup()
    print(f"load {loaded - started:.2f} s, warmup {time.perf_counter() - loaded:.2f} s",
          file=sys.stderr, flush=True)
    indexes = check_memory(spec.memory)  # a memory left by a killed process: made whole now
    print(f"memory: {len(indexes)} scope(s), {sum(indexes.values())} indexed rows",
          file=sys.stderr, flush=True)
    server = OpenAIServer(spec, config, service)
    # Everything made so far (the model, the memory, the app) lives as long as the process: kept
    # out of the cyclic collector's full passes, which would otherwise walk it all every few
    # hundred allocations (a sixth of a step's time on the CPU, BENCHMARKS.md).
    gc.collect()
    gc.freeze()
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"serving {config.models[0]} at http://{shown}:{bound_port}/v1", file=sys.stderr,
          flush=True)
    try:
        serve_until_stopped(server.app, sock, server.lifecycle, log_level=log_level)
    finally:
        shut_down(server.executor, spec.memory)
        sock.close()


def _placement(device: str | None, dtype: str | None) -> tuple[str | None, str | None]:
    """``--device`` and ``--dtype`` checked as ``Speculator.from_pretrained`` checks them,
    before the socket is bound or the model loads: a bad value exits 2 naming the option."""
    from agentspec.engine.load import as_device, as_dtype, quantized

    try:
        placed = as_device(device) if device is not None else None
    except ValueError as e:
        fail(f"--device {device!r}: {e}", EXIT_USAGE)
    try:
        if not quantized(dtype):
            as_dtype(dtype)
    except ValueError as e:
        fail(f"--dtype {dtype!r}: {e}", EXIT_USAGE)
    return placed, dtype


def _check_quantize(model: str, device: str | None, dtype: str | None,
                    quantize: str | None) -> None:
    """``--quantize`` checked against ``--model``, ``--device`` and ``--dtype`` as
    ``load_target`` checks it, before the socket is bound or the model loads: exit 2 naming
    the option."""
    from agentspec.engine.load import check_quantize

    try:
        check_quantize(model, device, dtype, quantize)
    except ValueError as e:
        fail(f"--quantize {quantize!r}: {e}", EXIT_USAGE)


def _read_keys(path: Path) -> dict[str, tuple[str, ...]]:
    """``--keys``: key -> its scopes; an unreadable or malformed file exits 2."""
    value = read_json_file(path, "--keys")
    if not isinstance(value, dict) or not value:
        fail(f"--keys file {str(path)!r} must hold a non-empty JSON object of key: scope(s)",
             EXIT_USAGE)
    out = {}
    for key, scopes in value.items():
        scopes = [scopes] if isinstance(scopes, str) else scopes
        if not isinstance(scopes, list) or not scopes or not all(isinstance(s, str) for s in scopes):
            fail(f"--keys file {str(path)!r}: the scopes of a key must be a string or a "
                 f"non-empty list of strings, got {scopes!r:.60}", EXIT_USAGE)
        out[key] = tuple(scopes)
    return out


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (bound before the model loads: a busy port fails
    at once)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        fail(f"--host {host!r} is not an address of this machine: {e.strerror}", EXIT_USAGE)
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        fail(f"cannot listen on {host}:{port}: {e.strerror}")
    sock.set_inheritable(True)
    return sock


