"""functopk: functional, optax-style gradient transformations for PyTorch with fast global top-k.

The public front: transformations and their combinators, applying updates,
the top-k functions, compressors, optimizers, schedules and checkpoints. The
namespaces ``ft.tree`` (tree maths, ``FlatLayout``), ``ft.sparse`` (the top-k
engine), ``ft.compress``, ``ft.optim`` (with the state classes), ``ft.nn`` and
``ft.distributed`` hold the rest. docs/api.md lists every name.

Example:
    >>> import torch, functopk as ft
    >>> tx = ft.chain(ft.topk(1000), ft.sgd(0.1))
"""

from functopk import compress, distributed, nn, optim, sparse, tree
from functopk.adapter import (
    ParamGroupOptimizer,
    from_torch,
    optimizer_class_from_torch,
    optimizer_from_torch,
    sparse_optimizer_class_from_torch,
    sparse_optimizer_from_torch,
)
from functopk.base import EmptyState, GradientTransformation, identity, stateless
from functopk.build import leafwise
from functopk.checkpoint import CheckpointError, load_state, save_state, state_from_dict, state_to_dict
from functopk.combine import chain, masked, named_chain, partition
from functopk.compress import (
    dgc,
    dgc_local_clipping,
    error_feedback,
    layerwise_topk,
    momentum_correction,
    randk,
    threshold,
    topk,
)
from functopk.inplace import update_
from functopk.optim import (
    adadelta,
    adafactor,
    adagrad,
    adam,
    adamax,
    adamw,
    add_decayed_weights,
    apply_if_finite,
    asgd,
    clip,
    clip_by_global_norm,
    inject_hyperparams,
    lamb,
    lion,
    multi_steps,
    muon,
    nadam,
    radam,
    rmsprop,
    rprop,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_rms,
    scale_by_rss,
    scale_by_schedule,
    scale_by_trust_ratio,
    sgd,
    trace,
    zero_nans,
)
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
from functopk.sparse import (
    SparseUpdates,
    apply_sparse_updates,
    apply_sparse_updates_,
    topk_indices,
    topk_mask,
    topk_sparsify,
)
from functopk.torch_optim import TorchOptimizer
from functopk.update import apply_updates, apply_updates_

__version__ = "0.2.0"

__all__ = [
    "CheckpointError",
    "EmptyState",
    "GradientTransformation",
    "ParamGroupOptimizer",
    "SparseUpdates",
    "TorchOptimizer",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "add_decayed_weights",
    "apply_if_finite",
    "apply_sparse_updates",
    "apply_sparse_updates_",
    "apply_updates",
    "apply_updates_",
    "asgd",
    "chain",
    "clip",
    "clip_by_global_norm",
    "compress",
    "constant_schedule",
    "cosine_decay_schedule",
    "dgc",
    "dgc_density_warmup",
    "dgc_local_clipping",
    "distributed",
    "error_feedback",
    "exponential_decay",
    "from_torch",
    "identity",
    "inject_hyperparams",
    "join_schedules",
    "lamb",
    "layerwise_topk",
    "leafwise",
    "linear_schedule",
    "lion",
    "load_state",
    "masked",
    "momentum_correction",
    "multi_steps",
    "muon",
    "nadam",
    "named_chain",
    "nn",
    "optim",
    "optimizer_class_from_torch",
    "optimizer_from_torch",
    "partition",
    "piecewise_constant_schedule",
    "radam",
    "randk",
    "rmsprop",
    "rprop",
    "save_state",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_schedule",
    "scale_by_trust_ratio",
    "sgd",
    "sparse",
    "sparse_optimizer_class_from_torch",
    "sparse_optimizer_from_torch",
    "state_from_dict",
    "state_to_dict",
    "stateless",
    "threshold",
    "topk",
    "topk_indices",
    "topk_mask",
    "topk_sparsify",
    "trace",
    "tree",
    "update_",
    "warmup_cosine_decay_schedule",
    "zero_nans",
]
