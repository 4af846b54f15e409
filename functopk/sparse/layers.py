"""Supported layers whose weight gradient is computed only at a claimed coordinate set: the one mechanism.

While a weight's coordinate set is fixed (a stream gathering between
refreshes, or :func:`functopk.sparse.grad_at`), the dense weight gradient of
``nn.Linear``, transformers' ``Conv1D`` (weight stored as ``(in, out)``),
``nn.Embedding`` and ``nn.Conv2d`` is not needed: only ``k_w`` of its numbers
are. Two global module hooks (installed while something uses them:
:func:`enable`) change such a layer's call:

* before ``forward``, if the layer's weight requires grad, grad mode is on, and
  the weight's *claim* is found (a :func:`claimed` block on this thread, or the
  live owner of its gradient hooks, :func:`functopk.sparse.hooks.owner_of`,
  through its ``sampling_claim(weight)``), the weight is replaced, for this
  call only, by ``weight.detach()``: the layer's own ``forward`` runs unchanged
  (the same output, bit for bit), and autograd computes the input's and the
  bias's gradients as before but no weight gradient;
* after it, the weight is put back and the output passes through an identity
  autograd function whose backward computes the weight gradient at the claimed
  coordinates (:mod:`functopk.sparse.sampled`) as the gradient of the claim's
  *coordinate leaf*, a ``k_w``-vector of zeros that requires grad.

The coordinate leaf is an ordinary autograd leaf, so everything autograd does
for leaves holds: a weight used by two layers (a token embedding tied to the
output layer) adds both contributions into its one leaf before the leaf's
post-accumulate-grad hook runs, once per backward; ``.grad`` accumulates over
backward passes; ``torch.autograd.grad`` can ask for it. A use of the weight
outside these layers still gives the weight a dense gradient (through its own
hooks), which the owner adds.

Not claimed (the layer runs as usual): other layer types or subclasses with
their own ``forward``, ``nn.Embedding`` with ``sparse=True`` or
``scale_grad_by_freq=True``, ``nn.Conv2d`` with a ``padding_mode`` other than
``"zeros"``, an input passed by keyword, grad mode off, and compiled code.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from functopk.sparse.hooks import owner_of
from functopk.sparse.sampled import conv2d_values, embedding_values, plan_conv2d, plan_product, sampled_product

__all__ = ["Claim", "claimed", "enable", "find_claim", "kind_of", "users"]


class Claim(NamedTuple):
    """A weight's coordinates: ``leaf`` (``k_w`` zeros requiring grad: its gradient is the weight's gradient at
    ``positions``), the ascending flat ``positions`` in the weight, and the kernels' plans for them (built once).

    Example:
        >>> import torch
        >>> claim = Claim(torch.zeros(2, requires_grad=True), torch.tensor([0, 5]), {})
        >>> claim.leaf.shape
        torch.Size([2])
    """

    leaf: torch.Tensor
    positions: torch.Tensor
    plans: dict[Any, Any]


def _plan(claim: Claim, key: Any, build: Callable[[], Any]) -> Any:
    if key not in claim.plans:
        claim.plans[key] = build()
    return claim.plans[key]


def _rows_by_cols(positions: torch.Tensor, shape: torch.Size) -> Any:
    """The product plan of a 2-d weight's flat ``positions``: row ``p // cols``, column ``p % cols``."""
    return plan_product(positions // shape[1], positions % shape[1])


class _Kind:
    """A supported layer type: what its call needs at backward (``spec``, ``None``: not claimed) and the values."""

    def spec(self, module: Any) -> tuple[Any, ...] | None:
        return ()

    def values(self, inp: torch.Tensor, dy: torch.Tensor, shape: torch.Size, spec: Any, claim: Claim) -> torch.Tensor:
        raise NotImplementedError


class _Linear(_Kind):
    """``y = x W^T + b``, ``W`` of shape ``(out, in)``: rows index ``dy``, columns ``x``."""

    def values(self, inp: torch.Tensor, dy: torch.Tensor, shape: torch.Size, spec: Any, claim: Claim) -> torch.Tensor:
        plan = _plan(claim, "linear", lambda: _rows_by_cols(claim.positions, shape))
        return sampled_product(dy.reshape(-1, shape[0]), inp.reshape(-1, shape[1]), plan)


class _Conv1D(_Kind):
    """transformers' ``Conv1D``: ``y = x W + b``, ``W`` of shape ``(in, out)``: rows index ``x``, columns ``dy``."""

    def values(self, inp: torch.Tensor, dy: torch.Tensor, shape: torch.Size, spec: Any, claim: Claim) -> torch.Tensor:
        plan = _plan(claim, "conv1d", lambda: _rows_by_cols(claim.positions, shape))
        return sampled_product(inp.reshape(-1, shape[0]), dy.reshape(-1, shape[1]), plan)


class _Embedding(_Kind):
    def spec(self, module: Any) -> tuple[Any, ...] | None:
        if module.sparse or module.scale_grad_by_freq:
            return None
        return (module.padding_idx,)

    def values(self, inp: torch.Tensor, dy: torch.Tensor, shape: torch.Size, spec: Any, claim: Claim) -> torch.Tensor:
        rows, cols = _plan(claim, "embedding", lambda: (claim.positions // shape[1], claim.positions % shape[1]))
        return embedding_values(inp, dy, rows, cols, spec[0])


class _Conv2d(_Kind):
    def spec(self, module: Any) -> tuple[Any, ...] | None:
        if module.padding_mode != "zeros":
            return None
        if module.padding == "same":  # F.conv2d pads d * (k - 1) in all, the odd one at the end
            pad = [d * (k - 1) // 2 for d, k in zip(module.dilation, module.kernel_size)]
        else:
            pad = [0, 0] if module.padding == "valid" else list(module.padding)
        return tuple(module.stride), tuple(pad), tuple(module.dilation), module.groups

    def values(self, inp: torch.Tensor, dy: torch.Tensor, shape: torch.Size, spec: Any, claim: Claim) -> torch.Tensor:
        stride, pad, dilation, groups = spec
        plan = _plan(claim, ("conv2d", groups), lambda: plan_conv2d(claim.positions, tuple(shape), groups))
        return conv2d_values(inp, dy, plan, stride, pad, dilation)


_KINDS: dict[type, _Kind | None] = {}


def kind_of(module: nn.Module) -> _Kind | None:
    """The supported kind of ``module``'s type, or ``None``: its ``forward`` must be the supported class's own.

    Example:
        >>> import torch
        >>> kind_of(torch.nn.Linear(2, 3)) is not None, kind_of(torch.nn.LayerNorm(3))
        (True, None)
    """
    cls = type(module)
    if cls not in _KINDS:
        _KINDS[cls] = None
        for base, kind in _supported():
            if issubclass(cls, base) and getattr(cls, "forward", None) is getattr(base, "forward", None):
                _KINDS[cls] = kind
    return _KINDS[cls]


def _supported() -> list[tuple[type, _Kind]]:
    out: list[tuple[type, _Kind]] = [(nn.Linear, _Linear()), (nn.Embedding, _Embedding()), (nn.Conv2d, _Conv2d())]
    try:  # transformers is optional; GPT-2's layers are its Conv1D
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is installed in the test environment
        return out
    return [*out, (Conv1D, _Conv1D())]


class _Attach(torch.autograd.Function):
    """The identity on a layer's output whose backward gives the claim's leaf the weight gradient at its positions."""

    @staticmethod
    def forward(
        ctx: Any, output: torch.Tensor, inp: torch.Tensor, leaf: torch.Tensor, meta: tuple[Any, ...]
    ) -> torch.Tensor:
        ctx.mark_dirty(output)  # the output itself, not a view: later in-place ops on it stay allowed
        ctx.save_for_backward(inp)
        ctx.meta = meta
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (inp,) = ctx.saved_tensors
        kind, shape, spec, claim = ctx.meta
        values = kind.values(inp, grad, shape, spec, claim).to(claim.leaf.dtype)
        return grad, None, values, None


def _attach(output: torch.Tensor, inp: torch.Tensor, meta: tuple[Any, ...]) -> torch.Tensor:
    """``output`` through :class:`_Attach`; a whole-tensor reshape (``Conv1D``'s ``.view``) is attached at its base."""
    leaf = meta[3].leaf
    base = output._base
    if (
        base is not None
        and base.numel() == output.numel()
        and base.is_contiguous()
        and output.is_contiguous()
        and base.storage_offset() == output.storage_offset()
    ):
        return _Attach.apply(base, inp, leaf, meta).view(output.shape)
    return _Attach.apply(output, inp, leaf, meta)


_LOCAL = threading.local()  # .calls: the claimed calls in flight; .contexts: the claimed() blocks


def _thread_list(name: str) -> list[Any]:
    if not hasattr(_LOCAL, name):
        setattr(_LOCAL, name, [])
    return getattr(_LOCAL, name)


def find_claim(weight: torch.Tensor) -> Claim | None:
    """The claim on ``weight``: the innermost :func:`claimed` block's, else its hooks' owner's, else ``None``."""
    for claims in reversed(_thread_list("contexts")):
        if id(weight) in claims:
            return claims[id(weight)][1]
    claim_of = getattr(owner_of(weight), "sampling_claim", None)
    return None if claim_of is None else claim_of(weight)


def _before(module: nn.Module, args: tuple[Any, ...]) -> None:
    if torch.compiler.is_compiling():  # first: compiled code reads nothing of this module (no guards on it)
        return
    kind = kind_of(module)
    if kind is None or not args or not isinstance(args[0], torch.Tensor) or not torch.is_grad_enabled():
        return
    parameters: dict[str, Any] = module._parameters
    weight = parameters.get("weight")
    if weight is None or not weight.requires_grad:
        return
    spec = kind.spec(module)
    claim = None if spec is None else find_claim(weight)
    if claim is None:
        return
    parameters["weight"] = weight.detach()  # this call only: no dense weight gradient
    _thread_list("calls").append((module, weight, (kind, weight.shape, spec, claim)))


def _after(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    if torch.compiler.is_compiling():
        return None
    calls = _thread_list("calls")
    if not calls or calls[-1][0] is not module:
        return None
    _, weight, meta = calls.pop()
    module._parameters["weight"] = weight
    if not isinstance(output, torch.Tensor):  # forward raised: nothing to attach
        return None
    return _attach(output, args[0], meta)


_LOCK = threading.Lock()
_HANDLES: list[Any] = []
_USERS = [0]


def enable() -> Callable[[], None]:
    """Install the two global module hooks (once, however many users); returns this user's release.

    The release is idempotent; the hooks go when the last user releases them.

    Example:
        >>> release = enable()
        >>> users() > 0
        True
        >>> release(); release()
    """
    with _LOCK:
        if _USERS[0] == 0:
            _HANDLES[:] = [
                nn.modules.module.register_module_forward_pre_hook(_before),
                nn.modules.module.register_module_forward_hook(_after, always_call=True),
            ]
        _USERS[0] += 1
    released = [False]

    def release() -> None:
        with _LOCK:
            if released[0]:
                return
            released[0] = True
            _USERS[0] -= 1
            if _USERS[0] == 0:
                for handle in _HANDLES:
                    handle.remove()
                _HANDLES.clear()

    return release


def users() -> int:
    """How many users hold the global module hooks (installed while there is one).

    Example:
        >>> before = users()
        >>> release = enable()
        >>> users() - before
        1
        >>> release()
    """
    return _USERS[0]


@contextlib.contextmanager
def claimed(claims: dict[int, tuple[torch.Tensor, Claim]]) -> Iterator[None]:
    """A block in which the supported layers of this thread use ``claims``: ``id(weight) -> (weight, claim)``.

    The weights are held by the mapping for the block, so their ids stay theirs.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(3, 2, bias=False)
        >>> claim = Claim(torch.zeros(1, requires_grad=True), torch.tensor([4]), {})     # W[1, 1]
        >>> with claimed({id(layer.weight): (layer.weight, claim)}):
        ...     layer(torch.tensor([[1.0, 2.0, 3.0]])).sum().backward()
        >>> claim.leaf.grad, layer.weight.grad
        (tensor([2.]), None)
    """
    contexts = _thread_list("contexts")
    contexts.append(claims)
    release = enable()
    try:
        yield
    finally:
        release()
        del contexts[next(i for i, c in enumerate(contexts) if c is claims)]
