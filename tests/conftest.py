"""Shared fixtures. The real packaged model loads once per test session."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from agentspec.engine.fused import interpret_without_gpu

# Without CUDA the fused forward's Triton kernels run in Triton's interpreter, which must be
# chosen before Triton is first imported (transformers' models import it through torch).
interpret_without_gpu()

PG_HINT = ("PostgreSQL tests need AGENTSPEC_TEST_PG_URL; to run them: "
           "AGENTSPEC_TEST_PG_URL=$(bash .ci/postgres.sh) make test")


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n 2`` (``make test``) each worker runs torch on one thread: two workers
    on the 2 cores instead of four threads fighting over them. Subprocesses inherit it."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = "1"
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def spec():
    """The real packaged SmolLM2-135M-Instruct with prompt lookup only (no memory), in fp32:
    the reference mode, whose greedy output is transformers' ``generate``'s (the file's own
    weights, the CPU's default for it, have their own tests: ``tests/unit/test_quant.py``,
    and the ``gguf`` cases of the invariance and batching tests)."""
    from agentspec import Speculator

    return Speculator.from_pretrained("smollm2-135m-instruct", memory=None, dtype="float32")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Torch single-threaded for a module of tiny-tensor tests: intra-op threads only add
    synchronisation cost there (7 ms per softmax when the machine is busy). Request it with
    ``pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards."""
    url = os.environ.get("AGENTSPEC_TEST_PG_URL")
    if not url:
        pytest.skip(PG_HINT)
    from sqlalchemy import create_engine

    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in url else "?"
    yield f"{url}{sep}options=-csearch_path%3D{schema}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
    engine.dispose()
