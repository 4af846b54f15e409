"""Small models and drivers shared by several test modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad

import functopk as ft


def small_cnn(num_classes: int = 3) -> nn.Module:
    """A CNN with BatchNorm, small enough for fast (and compiled) tests."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, num_classes),
    )


def batch(n: int = 8, size: int = 8, num_classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, size, size, generator=g), torch.randint(0, num_classes, (n,), generator=g)


def make_step(model_fn, tx):
    """The canonical functional training step: grad -> update -> apply."""

    def loss_fn(params, buffers, x, y):
        out, new_buffers = model_fn(params, buffers, x)
        return F.cross_entropy(out, y), new_buffers

    def step(params, buffers, opt_state, x, y):
        grads, buffers = grad(loss_fn, has_aux=True)(params, buffers, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return ft.apply_updates(params, updates), buffers, opt_state

    return step
