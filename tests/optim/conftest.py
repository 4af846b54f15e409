"""Fixtures for the optim tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every optim test runs on tiny tensors: one thread (the fixture in tests/conftest.py)."""
