"""Futures that DDP can read: a failed exchange must reach DDP as an error, not as a value.

``torch.futures.Future.set_exception`` stores the exception as the future's
*value*; only Python's ``wait()`` raises it. DDP reads a hook's future in C++,
takes that value for the bucket and fails with ``Unable to cast <message> to
Tensor``, which hides the message. A future completed by a ``then`` callback
that raises carries a real error, and DDP raises it from ``backward()``
with the message (after torch's "Got the following error when running the
callback").
"""

from __future__ import annotations

from typing import TypeVar

import torch

__all__: list[str] = []

T = TypeVar("T")


def _value(fut: torch.futures.Future[T]) -> T:
    return fut.wait()  # raises what set_exception stored: the then() future fails with it


def readable(fut: torch.futures.Future[T]) -> torch.futures.Future[T]:
    """A future of ``fut``'s value that fails with a real error where ``fut`` was failed with ``set_exception``."""
    return fut.then(_value)


def failed(exc: Exception) -> torch.futures.Future[torch.Tensor]:
    """A completed future that DDP sees failed with ``exc``."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_exception(exc)  # type: ignore[arg-type]  # torch annotates it as the result type
    return readable(fut)
