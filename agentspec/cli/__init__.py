"""The ``agentspec`` command line: ``cache`` (the completion memory), ``head`` (the draft head),
``models`` (the packaged models),
``generate``, ``serve`` (an OpenAI-compatible server, :mod:`agentspec.cli.serve`), ``demo``,
``bench``.

The package: this module (the Typer app, ``generate``, ``demo``, ``bench``), ``cache`` (read and
delete commands), ``cache_io`` (export, import), ``verify`` (reindex, verify) and ``common``
(options, errors, output). The ``bench`` command mounts :mod:`agentspec.cli.bench`.

Exit codes: 0 success, 1 failure, 2 usage or bad input, 3 not found (one line on stderr, no
traceback; under ``--json`` the error as JSON on stdout too).
``--db URL`` and ``--json`` go before the command or after any ``cache`` command
(``agentspec cache stats --db URL --json``); ``--db`` defaults to ``$AGENTSPEC_DB``, else the
SQLite file under ``$AGENTSPEC_HOME``.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from agentspec.cli.cache import cache_app
from agentspec.cli.common import (
    APP_SETTINGS,
    EXIT_USAGE,
    JSON_FLAG,
    JsonOpt,
    Options,
    db_option,
    db_url,
    fail,
    handles_errors,
    load_speculator,
    print_json,
    read_json_file,
    want_json,
)
from agentspec.cli.demo import demo
from agentspec.cli.head import head_app
from agentspec.cli.models import models_app
from agentspec.cli.serve import serve

app = typer.Typer(
    name="agentspec", no_args_is_help=True, **APP_SETTINGS,
    help="Exact speculative decoding for LLM agents, with a completion memory.\n\n"
         "Example: agentspec cache stats",
)
app.add_typer(cache_app, name="cache")
app.add_typer(head_app, name="head")
app.command("serve")(serve)
app.add_typer(models_app, name="models")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"agentspec {version('agentspec-llm')}")
        except PackageNotFoundError:  # a source tree that was never installed
            typer.echo("agentspec (not installed: no version)")
        raise typer.Exit()


@app.callback()
def _root(ctx: typer.Context,
          db: Annotated[str | None, db_option(envvar="AGENTSPEC_DB", show_envvar=True)] = None,
          json_out: JsonOpt = False,
          _show_version: Annotated[bool, typer.Option(
              "--version", callback=_version, is_eager=True,
              help="Print agentspec's version and exit.")] = False) -> None:
    ctx.obj = Options(db=db, json=json_out)


def _summary(stats: Any) -> str:
    drafted, accepted = sum(stats.drafted.values()), sum(stats.accepted.values())
    rate = f"{accepted / drafted:.0%}" if drafted else "n/a"
    by_source = ", ".join(f"{k} {stats.accepted.get(k, 0)}/{v}" for k, v in stats.drafted.items())
    return (f"{stats.new_tokens} tokens in {stats.seconds:.2f} s "
            f"({stats.tokens_per_second:.1f} tok/s), {stats.steps} steps "
            f"({stats.tokens_per_step:.2f} tokens/step), accepted {accepted}/{drafted} draft "
            f"tokens ({rate})" + (f" [{by_source}]" if by_source else ""))


@app.command("generate")
@handles_errors
def generate(ctx: typer.Context, prompt: str,
             model: Annotated[str, typer.Option(
                 "--model", help="Packaged name, model folder, .gguf file or hub id (org/name).")] = "smollm2-135m-instruct",
             max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 128,
             temperature: Annotated[float, typer.Option("--temperature", min=0.0,
                                                        help="0 is greedy.")] = 0.0,
             scope: Annotated[str, typer.Option("--scope", help="Memory scope.")] = "default",
             no_stream: Annotated[bool, typer.Option("--no-stream", help="Print at the end.")] = False,
             raw: Annotated[bool, typer.Option(
                 "--raw", help="Send PROMPT as raw text, not as a user message through the "
                               "chat template.")] = False,
             json_schema: Annotated[Path | None, typer.Option(
                 "--json-schema", help="A JSON schema file: the output is one JSON value valid "
                                       "under it (grammar-constrained, exact).")] = None,
             tools: Annotated[Path | None, typer.Option(
                 "--tools", help="A JSON file with a list of tools (OpenAI style or "
                                 "{name, parameters}): the output is one valid call of one of "
                                 "them.")] = None,
             regex: Annotated[str | None, typer.Option(
                 "--regex", help="The output matches this regular expression in full.")] = None,
             ) -> None:
    """Generate a completion: text on stdout, a speed/acceptance summary on stderr (with
    --json before the command: one JSON value on stdout, the text, its token ids and figures).

    The summary gives the load (model conversion or loading, the memory) and the warmup
    (forward cost calibration, the embedder) apart from the generation time and speed.
    At most one of --json-schema, --tools and --regex constrains the output.

    Example: agentspec generate "Write a haiku about caches" --max-new-tokens 64
    """
    from agentspec.config import SamplingParams

    sampling = SamplingParams(temperature=temperature,
                              grammar=_grammar(json_schema, tools, regex))
    request: Any = prompt if raw else [{"role": "user", "content": prompt}]
    started = time.perf_counter()
    spec = load_speculator(model, db_url(ctx))
    loaded = time.perf_counter()
    spec.warmup()  # the forward width check, cost calibration and embedder, before the call
    warmed = time.perf_counter()
    print(f"load {loaded - started:.2f} s, warmup {warmed - loaded:.2f} s (not counted in the "
          f"generation time below)", file=sys.stderr, flush=True)
    if want_json(ctx):  # one JSON value on stdout: the text, its token ids and the figures
        gen = spec.generate(request, max_new_tokens, sampling=sampling, scope=scope)
        st = gen.stats
        print_json({"text": gen.text, "token_ids": list(gen.token_ids), "stats": {
            "new_tokens": st.new_tokens, "prompt_tokens": st.prompt_tokens,
            "cached_tokens": st.cached_tokens, "steps": st.steps, "seconds": st.seconds,
            "first_token_seconds": st.first_token_seconds,
            "tokens_per_second": st.tokens_per_second, "tokens_per_step": st.tokens_per_step,
            "drafted": dict(st.drafted), "accepted": dict(st.accepted)}})
        stats = st
    elif no_stream:
        gen = spec.generate(request, max_new_tokens, sampling=sampling, scope=scope)
        sys.stdout.write(gen.text + "\n")
        stats = gen.stats
    else:
        stream = spec.stream(request, max_new_tokens, sampling=sampling, scope=scope)
        for delta in stream:
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        assert stream.generation is not None  # set once the stream is exhausted
        stats = stream.generation.stats
    sys.stdout.flush()
    print(_summary(stats), file=sys.stderr)


def _grammar(json_schema: Path | None, tools: Path | None, regex: str | None) -> Any:
    """The constraint of ``generate``'s options, or None; a bad file or grammar exits 2."""
    given = [name for name, v in (("--json-schema", json_schema), ("--tools", tools),
                                  ("--regex", regex)) if v is not None]
    if len(given) > 1:
        fail(f"give at most one of --json-schema, --tools, --regex; got {', '.join(given)}",
             EXIT_USAGE)
    if not given:
        return None
    from agentspec.grammar import Grammar

    if regex is not None:
        return Grammar.regex(regex)
    path = json_schema if json_schema is not None else tools
    assert path is not None
    value = read_json_file(path, given[0])
    if tools is not None:
        if not isinstance(value, list):
            fail(f"--tools file {str(path)!r} must hold a JSON list of tools, got "
                 f"{type(value).__name__}", EXIT_USAGE)
        return Grammar.tool_calls(value)
    return Grammar.json_schema(value)


_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


app.command("demo")(demo)


@app.command("bench", context_settings=_PASS_THROUGH, add_help_option=False)
@handles_errors
def bench_command(ctx: typer.Context) -> None:
    """Benchmarks (agentspec.cli.bench); see: agentspec bench --help.

    Example: agentspec bench --help
    """
    if importlib.util.find_spec("agentspec.bench") is None:  # a build without the bench
        fail("benchmarks are not available: agentspec.bench is not installed in this build")
    from agentspec.cli.bench import bench_app

    command = typer.main.get_command(bench_app)
    args = list(ctx.args)
    if want_json(ctx):  # `agentspec --json bench ...`: the bench's own --json
        args.insert(0, JSON_FLAG)
    code = command.main(args=args, prog_name="agentspec bench", standalone_mode=False)
    if isinstance(code, int) and code:
        raise typer.Exit(code)


def main() -> None:
    """The console script ``agentspec``."""
    try:
        app()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
