"""The one thread that runs agentspec's torch work on the CPU.

torch's CPU kernels run their parallel regions on OpenMP (libgomp). Each thread that opens a
parallel region gets a team of workers of its own, kept for the thread's life, and once more
workers exist than cores, libgomp stops letting them spin between regions: every region then
wakes its workers from sleep. Measured here (2 cores): with the loading thread's team alive,
a SmolLM2-135M forward on a second thread took 88 ms where it took 64 ms on the first, an
elementwise product of 36,000 floats 160 us where it took 16 us. A server's calls come from
worker threads, and the scheduler's steps are led by whichever caller needs one, so on the
CPU every forward, verification, model load and key embedding of agentspec runs here instead:
one thread, one team.

On CUDA the work is queued to the device from any thread and nothing of this applies.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_LOCK = threading.Lock()
_EXECUTOR: ThreadPoolExecutor | None = None
_IDENT: int | None = None


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    with _LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(1, thread_name_prefix="agentspec-torch",
                                           initializer=_remember)
        return _EXECUTOR


def _remember() -> None:
    global _IDENT
    _IDENT = threading.get_ident()


def on_torch_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the torch thread, waited for (its exception raised here); at
    once when called there already."""
    if threading.get_ident() == _IDENT:
        return fn(*args, **kwargs)
    return _executor().submit(fn, *args, **kwargs).result()


def inside() -> bool:
    """Whether this is the torch thread."""
    return threading.get_ident() == _IDENT


def for_device(device: Any, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the torch thread for work on the CPU (``device``'s type is
    ``"cpu"``), in this thread for any other device."""
    if getattr(device, "type", str(device)) == "cpu":
        return on_torch_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def device_work(method: Callable[..., T]) -> Callable[..., T]:
    """A method decorator: the method runs on the torch thread when its object's ``device`` is
    the CPU (see :func:`for_device`)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
        return for_device(self.device, method, self, *args, **kwargs)

    return wrapper
