"""functopk.sparse.config: one frozen object for the kernels' tuning constants."""

from __future__ import annotations

import dataclasses

import pytest

from functopk.sparse import KernelConfig
from functopk.sparse.config import DEFAULT_CONFIG


def test_default_config_holds_the_measured_constants():
    assert DEFAULT_CONFIG == KernelConfig()
    assert dataclasses.asdict(DEFAULT_CONFIG) == {
        "exact_min_numel": 1 << 16, "segment": 1 << 19, "sample_size": 1 << 16, "margin": 4.0, "band_min": 1 << 15,
        "max_rows": 256, "column_balance": 0.25, "column_max_fraction": 0.003, "words_max_fraction": 0.03,
        "min_columns": 256, "column_block": 1 << 21, "abandon_min": 1 << 16, "abandon_factor": 8.0, "native": True,
        "backend": "auto", "triton_block": 1 << 15, "triton_room": 2.0,
    }


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_CONFIG.segment = 8  # type: ignore[misc]
    assert dataclasses.replace(DEFAULT_CONFIG, segment=8).segment == 8


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"backend": "cuda"}, ValueError, "backend must be one of"),
        ({"backend": 1}, TypeError, "backend must be one of"),
        ({"triton_block": 96}, ValueError, "triton_block must be a power of 2"),
        ({"triton_block": 32}, ValueError, "triton_block"),
        ({"triton_block": 64.0}, TypeError, "triton_block must be an int"),
    ],
)
def test_backend_and_triton_block_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        KernelConfig(**kwargs)
