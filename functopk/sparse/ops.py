"""The exact kernels as custom operators: compiled graphs run the same kernels as eager mode.

:func:`~functopk.sparse.kernels.exact.select_exact` reads sizes and a
threshold on the host and returns data-dependent shapes, which
``torch.compile`` cannot trace. Registered as opaque operators with
``torch.library.custom_op``, it becomes one node of the compiled graph whose
output shapes are known in advance:

=========================  =====================  ==================================  ============================
operator                   Python name            output                              shape (fake implementation)
=========================  =====================  ==================================  ============================
``functopk::topk_dense``   :func:`exact_dense`    the sparsified leaves               the leaves' shapes and dtypes
``functopk::topk_masks``   :func:`exact_masks`    boolean leaves                      the leaves' shapes
``functopk::topk_indices`` :func:`exact_indices`  sorted flat indices and values      ``(k,)`` for an int ``k``;
                                                                                      data-dependent for a tensor
                                                                                      ``k``
=========================  =====================  ==================================  ============================

Each takes ``(leaves, k, k_tensor, config)``: ``k`` an int and ``k_tensor``
``None``, or ``k_tensor`` a 0-d tensor (then ``k`` is unused, 0), and
``config`` the :class:`~functopk.sparse.config.KernelConfig` as floats
(:func:`config_values`).

So a ``fullgraph=True`` step compiles without a graph break, runs the eager
kernel at eager speed, and selects bit for bit what eager mode selects. Values
of the gradients never cause a recompilation (they are data to the operator);
an int ``k`` is a constant of the graph (a new ``k`` recompiles, as any Python
int does), while a tensor ``k`` (a schedule, ``inject_hyperparams``) is an
input: it is read inside the operator, one host read of a CPU scalar (no
device synchronisation, as the operators only serve CPU leaves) per call, and
a NaN tensor ``k`` is the same ``ValueError`` as in eager mode.

The operators have no autograd formula: :func:`functopk.sparse.dispatch.select`
sends leaves that require grad to the static kernel instead, as in eager mode.

The Triton kernel (:mod:`~functopk.sparse.kernels.triton_select`: CUDA
tensors, or CPU tensors under ``TRITON_INTERPRET=1``) is one more operator,
``functopk::topk_triton`` (:func:`triton_topk`), taking ``(leaves, k,
k_tensor, output, config)`` with ``output`` one of ``"indices"``, ``"masks"``
and ``"dense"``. It never reads the device: its outputs have static shapes
(``(k,)`` indices and values for an int ``k``; a flat mask or flat values of
the tree's size), except the indices for a tensor ``k`` (their number is
``k``: one host read). :class:`TritonTopK` calls it when compiling and its
implementation directly in eager mode (the same code), so the selection is
the same both ways, and both can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functopk.sparse.config import BACKENDS, KernelConfig
from functopk.sparse.k import k_on_host
from functopk.sparse.kernels import triton_select
from functopk.sparse.kernels.base import common_dtype
from functopk.sparse.kernels.exact import select_exact
from functopk.sparse.selection import Indices, leaf_views, sparse_updates
from functopk.sparse.updates import SparseUpdates

__all__ = ["ExactOp", "TritonTopK", "config_values", "exact_dense", "exact_indices", "exact_masks", "triton_topk"]

_FIELDS = dataclasses.fields(KernelConfig)


def config_values(config: KernelConfig) -> list[float]:
    """``config`` as the list of floats the operators take (custom operators take no Python objects).

    Example:
        >>> from functopk.sparse.config import DEFAULT_CONFIG
        >>> _config(config_values(DEFAULT_CONFIG)) == DEFAULT_CONFIG
        True
    """
    return [float(BACKENDS.index(config.backend)) if f.name == "backend" else float(getattr(config, f.name))
            for f in _FIELDS]


def _config(values: list[float]) -> KernelConfig:
    """The :class:`KernelConfig` that :func:`config_values` flattened (int fields come back as ints)."""
    cast: dict[str, Callable[[float], Any]] = {"int": int, "bool": bool, "str": lambda v: BACKENDS[int(v)]}
    kw: dict[str, Any] = {f.name: cast.get(str(f.type), float)(v) for f, v in zip(_FIELDS, values)}
    return KernelConfig(**kw)


def _indices(leaves: list[torch.Tensor], k: int, k_tensor: torch.Tensor | None, config: list[float]) -> Indices:
    """The eager exact kernel on the operator's (real) inputs."""
    k = k_on_host(k_tensor if k_tensor is not None else k, sum(x.numel() for x in leaves))
    flats = [x.detach().reshape(-1) for x in leaves]
    return Indices(*select_exact(flats, k, common_dtype(leaves), _config(config)))


def _per_leaf_op(output: str, dtype_of: Callable[[torch.Tensor], torch.dtype]):
    """Register ``functopk::topk_<output>``: one output per leaf, with the leaf's shape (``Indices.<output>``)."""

    def impl(
        leaves: list[torch.Tensor], k: int, k_tensor: torch.Tensor | None, config: list[float]
    ) -> list[torch.Tensor]:
        return getattr(_indices(leaves, k, k_tensor, config), output)(leaves)

    op = torch.library.custom_op(f"functopk::topk_{output}", impl, mutates_args=())

    @op.register_fake
    def _(leaves, k, k_tensor, config):
        return [torch.empty(x.shape, dtype=dtype_of(x), device=x.device) for x in leaves]

    return op


exact_dense = _per_leaf_op("dense", lambda x: x.dtype)
"""``exact_dense(leaves, k, k_tensor, config)``: the sparsified leaves, zeros except the exact top ``k``.

>>> from functopk.sparse.config import DEFAULT_CONFIG
>>> exact_dense([torch.tensor([1.0, -3.0, 2.0])], 1, None, config_values(DEFAULT_CONFIG))
[tensor([ 0., -3.,  0.])]
"""

exact_masks = _per_leaf_op("masks", lambda x: torch.bool)
"""``exact_masks(leaves, k, k_tensor, config)``: boolean leaves, True at the exact top ``k``.

>>> from functopk.sparse.config import DEFAULT_CONFIG
>>> exact_masks([torch.tensor([1.0, -3.0, 2.0])], 2, None, config_values(DEFAULT_CONFIG))
[tensor([False,  True,  True])]
"""


@torch.library.custom_op("functopk::topk_indices", mutates_args=())
def exact_indices(
    leaves: list[torch.Tensor], k: int, k_tensor: torch.Tensor | None, config: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending flat indices and their values (common dtype) of the exact top ``k`` (or ``k_tensor``).

    Example:
        >>> import torch
        >>> from functopk.sparse.config import DEFAULT_CONFIG
        >>> exact_indices([torch.tensor([1.0, -3.0, 2.0])], 2, None, config_values(DEFAULT_CONFIG))
        (tensor([1, 2]), tensor([-3.,  2.]))
    """
    idx, vals = _indices(leaves, k, k_tensor, config)
    return idx, vals


@exact_indices.register_fake
def _(leaves, k, k_tensor, config):
    if k_tensor is None:
        size = k
    else:
        size = torch.library.get_ctx().new_dynamic_size(min=1, max=sum(x.numel() for x in leaves))
    device = leaves[0].device
    idx = torch.empty(size, dtype=torch.int64, device=device)
    return idx, torch.empty(size, dtype=common_dtype(leaves), device=device)


class ExactOp(NamedTuple):
    """The exact top-k, to be computed by the custom operators (what :func:`~.dispatch.select` returns when compiling).

    A :class:`~functopk.sparse.selection.Selection`: each output calls the one
    operator that produces it, so a compiled graph holds one opaque node per selection.
    """

    k: int
    k_tensor: torch.Tensor | None
    config: KernelConfig

    def dense(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The sparsified leaves (``functopk::topk_dense``)."""
        return exact_dense(leaves, self.k, self.k_tensor, config_values(self.config))

    def masks(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Boolean leaves (``functopk::topk_masks``)."""
        return exact_masks(leaves, self.k, self.k_tensor, config_values(self.config))

    def sparse(self, leaves: list[torch.Tensor]) -> SparseUpdates:
        """A :class:`~functopk.SparseUpdates` (``functopk::topk_indices``)."""
        idx, vals = exact_indices(leaves, self.k, self.k_tensor, config_values(self.config))
        return sparse_updates(leaves, idx, vals)


def _triton_outputs(
    leaves: list[torch.Tensor], k: int, k_tensor: torch.Tensor | None, output: str, config: KernelConfig
) -> list[torch.Tensor]:
    """The Triton kernel's ``output`` (see :func:`~functopk.sparse.kernels.triton_select.run`)."""
    out = triton_select.run(leaves, k if k_tensor is None else k_tensor, output, config)
    if output == "indices" and k_tensor is not None:  # k of the n-sized buffers hold the selection
        size = int(k_tensor)
        return [out[0][:size], out[1][:size]]
    return out


@torch.library.custom_op("functopk::topk_triton", mutates_args=())
def triton_topk(
    leaves: list[torch.Tensor], k: int, k_tensor: torch.Tensor | None, output: str, config: list[float]
) -> list[torch.Tensor]:
    """The Triton kernel's ``output`` for the top ``k`` (or ``k_tensor``: int64 in ``[1, n]`` on the leaves' device).

    ``"indices"``: ascending flat indices and their values (common dtype); ``"masks"``: a flat bool
    mask; ``"dense"``: the selected values (common dtype) in a flat buffer of zeros. Runs where
    :func:`~functopk.sparse.kernels.triton_select.serves` says it can (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``).

    Example:
        >>> triton_topk.__name__
        'triton_topk'
    """
    return _triton_outputs(leaves, k, k_tensor, output, _config(config))


@triton_topk.register_fake
def _(leaves, k, k_tensor, output, config):
    n, dtype, device = sum(x.numel() for x in leaves), common_dtype(leaves), leaves[0].device
    if output == "indices":
        size = k if k_tensor is None else torch.library.get_ctx().new_dynamic_size(min=1, max=n)
        return [torch.empty(size, dtype=torch.int64, device=device), torch.empty(size, dtype=dtype, device=device)]
    return [torch.empty(n, dtype=torch.bool if output == "masks" else dtype, device=device)]


class TritonTopK(NamedTuple):
    """The exact top-k by the Triton kernel (what :func:`~.dispatch.select` returns where it serves).

    A :class:`~functopk.sparse.selection.Selection`: each output runs the kernel for that output,
    through :func:`triton_topk` when compiling (one opaque node), directly otherwise.
    """

    k: int
    k_tensor: torch.Tensor | None
    config: KernelConfig

    def _run(self, leaves: list[torch.Tensor], output: str) -> list[torch.Tensor]:
        if torch.compiler.is_compiling():
            return triton_topk(leaves, self.k, self.k_tensor, output, config_values(self.config))
        return _triton_outputs(leaves, self.k, self.k_tensor, output, self.config)

    def dense(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The selected values in one flat buffer of zeros, cut into the leaves (mixed dtypes: a mask per leaf)."""
        dtype = common_dtype(leaves)
        if all(x.dtype == dtype for x in leaves):
            return leaf_views(self._run(leaves, "dense")[0], leaves)
        return [torch.where(m, x, 0.0) for m, x in zip(self.masks(leaves), leaves)]

    def masks(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """One flat mask, cut into the leaves."""
        return leaf_views(self._run(leaves, "masks")[0], leaves)

    def sparse(self, leaves: list[torch.Tensor]) -> SparseUpdates:
        """Ascending flat indices and their values: ``(k,)`` each for an int ``k``."""
        idx, vals = self._run(leaves, "indices")
        return sparse_updates(leaves, idx, vals)
