"""What the tests of ``functopk/sparse`` share: a watch for dense weight gradients and a tiny GPT-2."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import functopk as ft
from functopk.sparse import layers


class WeightShaped(TorchDispatchMode):
    """Records every op that makes a new tensor shaped like one of ``weights`` (or its transpose): a dense weight
    gradient (``mm``, ``convolution_backward``, ``embedding_dense_backward``, a zero buffer) would be one."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.shapes = {tuple(w.shape) for w in weights} | {tuple(w.shape[::-1]) for w in weights}
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        strided = [t for t in ft.tree.leaves((args, kwargs)) if isinstance(t, torch.Tensor) and not t.is_sparse_csr]
        storages = {t.untyped_storage().data_ptr() for t in strided}
        for t in ft.tree.leaves(out):  # a new strided tensor (not a view, not written in place; a sparse one is O(k))
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and tuple(t.shape) in self.shapes:
                if t.untyped_storage().data_ptr() not in storages:
                    self.seen.append(str(func))
        return out


def weights_of(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if layers.kind_of(m) is not None]


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """A 2-layer GPT-2 in float64: ``Conv1D`` layers and a token embedding tied to ``lm_head`` (tests using it are
    marked ``integrations``: transformers is imported here, not at CI's old end)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=29, n_positions=12,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config).double()
