"""Timing helpers shared by the device-aware benchmarks (compiled_step.py, device_topk.py, whole_step.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def device_sync(device: str) -> Callable[[], None]:
    """What waits for ``device``'s queued work: ``torch.cuda.synchronize`` on CUDA, nothing on the CPU."""
    return torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)


def first_call(fn: Callable[[], object], sync: Callable[[], None] = lambda: None) -> float:
    """Seconds of one call until its device work is done (for a compiled function: compile time plus one run)."""
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def interleaved(fns: dict, rounds: int, sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median seconds per call of each function, one warm-up call each, then measured round by round."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(first_call(fn, sync))
    return {name: statistics.median(v) for name, v in times.items()}


def event_times(fns: dict, rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each function: ``calls`` calls between two CUDA events, rounds interleaved."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 1e3 / calls)
    return {name: statistics.median(v) for name, v in times.items()}


def medians(fns: dict, rounds: int, calls: int, device: str) -> dict[str, float]:
    """Median seconds per call: :func:`event_times` on CUDA (``calls`` per timed batch), else :func:`interleaved`."""
    if str(device).startswith("cuda"):
        return event_times(fns, rounds, calls)
    return interleaved(fns, rounds, device_sync(device))
