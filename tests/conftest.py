"""Fixtures and the hypothesis profile; assertions and models are in tests/helpers.py."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from functopk._compat import COMPILE_TOO_OLD

settings.register_profile(
    "default",
    deadline=None,
    max_examples=int(os.environ.get("FUNCTOPK_HYPOTHESIS_EXAMPLES", "100")),
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=False,
)
settings.load_profile("default")


def pytest_collection_modifyitems(config, items):
    """On a torch too old to compile functopk (before 2.10), tests marked ``compile`` skip, saying why.

    ``tests/test_compat.py`` checks there that compiling functopk code fails with that message.
    """
    if COMPILE_TOO_OLD is not None:
        for item in items:
            if item.get_closest_marker("compile") is not None:
                item.add_marker(pytest.mark.skip(reason=COMPILE_TOO_OLD))

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")],
    ),
]
"""The devices of the ``device`` fixture: every CUDA case carries ``pytest.mark.cuda`` (``pytest -m cuda``)."""


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> str:
    """Each device-agnostic test runs on every device: "cpu", and "cuda" (skipped without a GPU).

    Session-scoped: it is only a name, and hypothesis refuses function-scoped
    fixtures in ``@given`` tests (its ``function_scoped_fixture`` health check).
    """
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture()
def fresh_dynamo():
    """A clean torch._dynamo cache before and after the test (recompile checks count from zero)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one thread avoids OpenMP hand-offs (up to 20x faster on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
