"""Optimizer building blocks and the optimizers made of them (``ft.optim``).

* :mod:`~functopk.optim.elementary`: ``scale``, ``scale_by_schedule``,
  ``scale_by_learning_rate``, ``trace``, ``add_decayed_weights``;
* :mod:`~functopk.optim.adaptive`: ``scale_by_adam``; :mod:`~functopk.optim.rms`: ``scale_by_rms``, ``scale_by_rss``;
* :mod:`~functopk.optim.clipping`: ``clip``, ``clip_by_global_norm``, ``zero_nans``, ``apply_if_finite``;
* :mod:`~functopk.optim.alias`: ``sgd``, ``adam``, ``adamw``, ``rmsprop``, ``adagrad``
  at ``torch.optim`` parity;
* at ``torch.optim`` parity too: :mod:`~functopk.optim.adam_variants` (``nadam``, ``radam``,
  ``adamax``), :mod:`~functopk.optim.classic` (``adadelta``, ``rprop``, ``asgd``),
  :mod:`~functopk.optim.adafactor`, :mod:`~functopk.optim.muon`;
* at optax parity: :mod:`~functopk.optim.lion` (``lion``, ``scale_by_lion``) and
  :mod:`~functopk.optim.lamb` (``lamb``, ``scale_by_trust_ratio``);
* :mod:`~functopk.optim.accumulate` (``multi_steps``) and
  :mod:`~functopk.optim.inject` (``inject_hyperparams``): wrappers.

The transformations are also at the top level (``ft.sgd``); their state
classes live here (``ft.optim.TraceState``).
"""

from functopk.optim.accumulate import MultiStepsState, multi_steps
from functopk.optim.adafactor import AdafactorState, adafactor
from functopk.optim.adam_variants import AdamaxState, NadamState, RadamState, adamax, nadam, radam
from functopk.optim.adaptive import ScaleByAdamState, scale_by_adam
from functopk.optim.alias import adagrad, adam, adamw, rmsprop, sgd
from functopk.optim.classic import AdadeltaState, AsgdState, RpropState, adadelta, asgd, rprop
from functopk.optim.clipping import ApplyIfFiniteState, apply_if_finite, clip, clip_by_global_norm, zero_nans
from functopk.optim.elementary import (
    ScaleByScheduleState,
    TraceState,
    WeightDecayScheduleState,
    add_decayed_weights,
    scale,
    scale_by_learning_rate,
    scale_by_schedule,
    trace,
)
from functopk.optim.inject import InjectHyperparamsState, inject_hyperparams
from functopk.optim.lamb import lamb, scale_by_trust_ratio
from functopk.optim.lion import ScaleByLionState, lion, scale_by_lion
from functopk.optim.muon import MuonState, muon
from functopk.optim.rms import ScaleByRmsState, ScaleByRssState, scale_by_rms, scale_by_rss

__all__ = [
    "AdadeltaState",
    "AdafactorState",
    "AdamaxState",
    "ApplyIfFiniteState",
    "AsgdState",
    "InjectHyperparamsState",
    "MultiStepsState",
    "MuonState",
    "NadamState",
    "RadamState",
    "RpropState",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "TraceState",
    "WeightDecayScheduleState",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "add_decayed_weights",
    "apply_if_finite",
    "asgd",
    "clip",
    "clip_by_global_norm",
    "inject_hyperparams",
    "lamb",
    "lion",
    "multi_steps",
    "muon",
    "nadam",
    "radam",
    "rmsprop",
    "rprop",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_schedule",
    "scale_by_trust_ratio",
    "sgd",
    "trace",
    "zero_nans",
]
