"""``TopKHookState(overlap=True)``: each bucket's selection runs off the backward thread.

DDP calls a communication hook on the thread running the backward pass, and
that thread does not go on with the remaining layers until the hook returns.
The top-k hook's synchronous part (add the residual, select, pack, start the
exchange) is most of its cost, so by default it delays the rest of the
backward pass. With ``overlap=True`` the hook only does its bookkeeping and
hands the rest to one worker thread per hook state, returning a future that
completes when the bucket's exchange has; the backward thread computes the
next layers' gradients meanwhile (PyTorch's kernels release the GIL).

Ordering is what keeps this correct: collectives must be issued in the same
order on every rank. One worker takes the buckets first in, first out, so
the hook's collectives keep DDP's bucket order. DDP issues its own
collectives after the last bucket's hook (e.g. the allreduce of the
used-parameter map with ``find_unused_parameters=True``), so the last bucket
waits until every earlier bucket's work has started and then runs on the
calling thread, as without overlap: nothing of the backward pass is left to
overlap with at that point anyway.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from functopk.distributed.futures import readable

__all__: list[str] = []

Launch = Callable[[], "torch.futures.Future[torch.Tensor]"]


class Offloader:
    """One daemon worker thread running bucket launches in submission order (started on first use)."""

    def __init__(self) -> None:
        self._tasks: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None

    def run(self, launch: Launch, *, inline: bool) -> torch.futures.Future[torch.Tensor]:
        """``launch()``'s future: on the worker, or (``inline``) here once all queued launches have run."""
        if inline:
            self.drain()
            return launch()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="functopk-topk-hook", daemon=True)
            self._thread.start()
        out: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._tasks.put((launch, out))
        return readable(out)  # failed with set_exception below: DDP must see an error, not a value

    def drain(self) -> None:
        """Wait until every queued launch has run (its exchange started, or its error set on its future)."""
        self._tasks.join()

    def _work(self) -> None:
        while True:
            launch, out = self._tasks.get()
            try:
                inner = launch()
            except BaseException as exc:  # delivered to DDP through the future
                out.set_exception(exc)  # torch annotates it as the result type
            else:
                inner.add_done_callback(lambda f, out=out: _forward(f, out))
            finally:
                self._tasks.task_done()


def _forward(inner: torch.futures.Future[torch.Tensor], out: torch.futures.Future[torch.Tensor]) -> None:
    try:
        value = inner.value()
    except BaseException as exc:
        out.set_exception(exc)  # type: ignore[arg-type]
    else:
        out.set_result(value)
