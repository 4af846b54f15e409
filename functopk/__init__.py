"""functopk: functional, optax-style gradient transformations for PyTorch with fast global top-k.

Example:
    >>> import torch, functopk as ft
    >>> tx = ft.chain(ft.topk(1000), ft.sgd(0.1))
"""

from functopk import nn
from functopk.alias import sgd
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
from functopk.combine import chain, named_chain
from functopk.inject import InjectHyperparamsState, inject_hyperparams
from functopk.schedules import (
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear_schedule,
    piecewise_constant_schedule,
    warmup_cosine_decay_schedule,
)
from functopk.sparsify import TopKState, gaussian_threshold, k_from_density, topk, topk_indices, topk_mask, topk_sparsify
from functopk.transforms import (
    ScaleByScheduleState,
    TraceState,
    scale,
    scale_by_learning_rate,
    scale_by_schedule,
    trace,
)
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
    "EmptyState",
    "FlatLayout",
    "GradientTransformation",
    "InjectHyperparamsState",
    "OptState",
    "Params",
    "PyTree",
    "ScalarOrSchedule",
    "ScaleByScheduleState",
    "Schedule",
    "SparseUpdates",
    "TopKState",
    "TraceState",
    "TransformInitFn",
    "TransformUpdateFn",
    "Updates",
    "apply_sparse_updates",
    "apply_sparse_updates_",
    "apply_updates",
    "apply_updates_",
    "chain",
    "check_same_structure",
    "constant_schedule",
    "cosine_decay_schedule",
    "exponential_decay",
    "gaussian_threshold",
    "identity",
    "inject_hyperparams",
    "join_schedules",
    "k_from_density",
    "linear_schedule",
    "named_chain",
    "nn",
    "piecewise_constant_schedule",
    "ravel_pytree",
    "scale",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "sgd",
    "stateless",
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
]
