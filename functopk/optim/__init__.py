"""Optimizer building blocks and the optimizers made of them (``ft.optim``).

* :mod:`~functopk.optim.elementary`: ``scale``, ``scale_by_schedule``,
  ``scale_by_learning_rate``, ``trace``, ``add_decayed_weights``;
* :mod:`~functopk.optim.adaptive`: ``scale_by_adam``, ``scale_by_rms``, ``scale_by_rss``;
* :mod:`~functopk.optim.clipping`: ``clip``, ``clip_by_global_norm``, ``zero_nans``, ``apply_if_finite``;
* :mod:`~functopk.optim.alias`: ``sgd``, ``adam``, ``adamw``, ``rmsprop``, ``adagrad``
  at ``torch.optim`` parity;
* :mod:`~functopk.optim.accumulate` (``multi_steps``) and
  :mod:`~functopk.optim.inject` (``inject_hyperparams``): wrappers.

The transformations are also at the top level (``ft.sgd``); their state
classes live here (``ft.optim.TraceState``).
"""

from functopk.optim.accumulate import MultiStepsState, multi_steps
from functopk.optim.adaptive import (
    ScaleByAdamState,
    ScaleByRmsState,
    ScaleByRssState,
    scale_by_adam,
    scale_by_rms,
    scale_by_rss,
)
from functopk.optim.alias import adagrad, adam, adamw, rmsprop, sgd
from functopk.optim.clipping import ApplyIfFiniteState, apply_if_finite, clip, clip_by_global_norm, zero_nans
from functopk.optim.elementary import (
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    scale,
    scale_by_learning_rate,
    scale_by_schedule,
    trace,
)
from functopk.optim.inject import InjectHyperparamsState, inject_hyperparams

__all__ = [
    "ApplyIfFiniteState",
    "InjectHyperparamsState",
    "MultiStepsState",
    "ScaleByAdamState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "TraceState",
    "adagrad",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_if_finite",
    "clip",
    "clip_by_global_norm",
    "inject_hyperparams",
    "multi_steps",
    "rmsprop",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_schedule",
    "sgd",
    "trace",
    "zero_nans",
]
