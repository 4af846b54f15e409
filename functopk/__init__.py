"""functopk: functional, optax-style gradient transformations for PyTorch with fast global top-k.

Example:
    >>> import torch, functopk as ft
    >>> tx = ft.chain(ft.topk(1000), ft.sgd(0.1))
"""

from functopk import distributed, nn
from functopk.accumulate import MultiStepsState, multi_steps
from functopk.adaptive import (
    ScaleByAdamState,
    ScaleByRmsState,
    ScaleByRssState,
    scale_by_adam,
    scale_by_rms,
    scale_by_rss,
)
from functopk.alias import adagrad, adam, adamw, rmsprop, sgd
from functopk.base import (
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    Schedule,
    ScalarOrSchedule,
    TransformInitFn,
    TransformUpdateFn,
    Updates,
    identity,
    stateless,
)
from functopk.checkpoint import CheckpointError, load_state, save_state, state_from_dict, state_to_dict
from functopk.clipping import (
    ApplyIfFiniteState,
    all_finite,
    apply_if_finite,
    clip,
    clip_by_global_norm,
    global_norm,
    zero_nans,
)
from functopk.combine import MaskedState, chain, masked, named_chain, partition
from functopk.compress import RandKState, layerwise_topk, randk, randk_mask, threshold
from functopk.deep_gradient_compression import (
    LocalWeightDecayState,
    MomentumCorrectionState,
    dgc,
    dgc_local_clipping,
    momentum_correction,
)
from functopk.feedback import ErrorFeedbackState, error_feedback
from functopk.inject import InjectHyperparamsState, inject_hyperparams
from functopk.schedules import (
    constant_schedule,
    cosine_decay_schedule,
    dgc_density_warmup,
    exponential_decay,
    join_schedules,
    linear_schedule,
    piecewise_constant_schedule,
    warmup_cosine_decay_schedule,
)
from functopk.sparsify import TopKState, gaussian_threshold, k_from_density, topk, topk_indices, topk_mask, topk_sparsify
from functopk.transforms import (
    MaskOrFn,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    scale,
    scale_by_learning_rate,
    scale_by_schedule,
    trace,
)
from functopk.torch_optim import TorchOptimizer
from functopk.tree import (
    FlatLayout,
    PyTree,
    check_same_structure,
    ravel_pytree,
    tree_add,
    tree_add_scaled,
    tree_leaves,
    tree_map,
    tree_scale,
    tree_zeros_like,
)
from functopk.update import SparseUpdates, apply_sparse_updates, apply_sparse_updates_, apply_updates, apply_updates_

__version__ = "0.1.0"

__all__ = [
    "ApplyIfFiniteState",
    "CheckpointError",
    "EmptyState",
    "ErrorFeedbackState",
    "FlatLayout",
    "GradientTransformation",
    "InjectHyperparamsState",
    "LocalWeightDecayState",
    "MaskOrFn",
    "MaskedState",
    "MomentumCorrectionState",
    "MultiStepsState",
    "OptState",
    "Params",
    "PyTree",
    "RandKState",
    "ScalarOrSchedule",
    "ScaleByAdamState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "Schedule",
    "SparseUpdates",
    "TopKState",
    "TorchOptimizer",
    "TraceState",
    "TransformInitFn",
    "TransformUpdateFn",
    "Updates",
    "adagrad",
    "adam",
    "adamw",
    "add_decayed_weights",
    "all_finite",
    "apply_if_finite",
    "apply_sparse_updates",
    "apply_sparse_updates_",
    "apply_updates",
    "apply_updates_",
    "chain",
    "check_same_structure",
    "clip",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "dgc",
    "dgc_density_warmup",
    "dgc_local_clipping",
    "distributed",
    "error_feedback",
    "exponential_decay",
    "gaussian_threshold",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "join_schedules",
    "k_from_density",
    "layerwise_topk",
    "linear_schedule",
    "load_state",
    "masked",
    "momentum_correction",
    "multi_steps",
    "named_chain",
    "nn",
    "partition",
    "piecewise_constant_schedule",
    "randk",
    "randk_mask",
    "ravel_pytree",
    "rmsprop",
    "save_state",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_schedule",
    "sgd",
    "state_from_dict",
    "state_to_dict",
    "stateless",
    "threshold",
    "topk",
    "topk_indices",
    "topk_mask",
    "topk_sparsify",
    "trace",
    "tree_add",
    "tree_add_scaled",
    "tree_leaves",
    "tree_map",
    "tree_scale",
    "tree_zeros_like",
    "warmup_cosine_decay_schedule",
    "zero_nans",
]
