"""Gradient compressors as transformations with dense outputs (``ft.compress``).

Each returns a tree like its input, zero except at the coordinates it keeps
("sends"), so they compose with each other and with the optimizers:

* :mod:`~functopk.compress.topk`: global ``topk`` (the selection is :mod:`functopk.sparse`);
* :mod:`~functopk.compress.randk`: ``randk``, ``randk_mask`` (a counter-based hash of seed, step, index);
* :mod:`~functopk.compress.threshold`: ``threshold``;
* :mod:`~functopk.compress.layerwise`: ``layerwise_topk`` (per-leaf top-k);
* :mod:`~functopk.compress.feedback`: ``error_feedback``;
* :mod:`~functopk.compress.stats`: ``compression_stats``, what a compressor kept at each step;
* :mod:`~functopk.compress.dgc`: Deep Gradient Compression: ``momentum_correction``,
  ``dgc_local_clipping``, ``dgc``, composed of ``trace``, ``error_feedback`` and ``masked``.
"""

from functopk.compress.dgc import (
    LocalWeightDecayState,
    MomentumCorrectionState,
    dgc,
    dgc_local_clipping,
    momentum_correction,
)
from functopk.compress.feedback import ErrorFeedbackState, error_feedback
from functopk.compress.layerwise import layerwise_topk
from functopk.compress.randk import RandKState, randk, randk_mask
from functopk.compress.stats import CompressionStats, CompressionStatsState, compression_stats
from functopk.compress.threshold import threshold
from functopk.compress.topk import TopKState, topk

__all__ = [
    "CompressionStats",
    "CompressionStatsState",
    "ErrorFeedbackState",
    "LocalWeightDecayState",
    "MomentumCorrectionState",
    "RandKState",
    "TopKState",
    "compression_stats",
    "dgc",
    "dgc_local_clipping",
    "error_feedback",
    "layerwise_topk",
    "momentum_correction",
    "randk",
    "randk_mask",
    "threshold",
    "topk",
]
