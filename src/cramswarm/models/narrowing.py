"""SWARM's compression-aware layers (swarm.md 2.2), which a crammed BERT split into stages holds at the end of every
stage but the last (``CrammedBertConfig.boundary_*``): ``Bottleneck`` and ``Maxout``, through which only a narrower
tensor crosses the boundary. :func:`split_narrowing` cuts one in two halves: the sending stage ends with the
narrowing half (:class:`NarrowingSend`) and the next stage starts with the widening ``up`` projection."""

from __future__ import annotations

import torch
from torch import nn

from cramswarm.codec import boundary, check_scheme


def make_narrowing(kind: str, hidden: int, factor: int, eps: float = 1e-12) -> nn.Module:
    if kind == "bottleneck":
        return Bottleneck(hidden, factor, eps=eps)
    if kind == "maxout":
        return Maxout(hidden, factor, eps=eps)
    raise ValueError(f"unknown narrowing layer {kind!r}; allowed: bottleneck, maxout")


class NarrowingSend(nn.Module):
    """The sending half of a ``Bottleneck`` or ``Maxout``: everything before the boundary (its modules are the
    layer's own, under the same names); its output is the narrowed tensor."""

    def __init__(self, layer: Bottleneck | Maxout):
        super().__init__()
        self.kind = type(layer).__name__
        for name in layer.SEND:
            self.add_module(name, getattr(layer, name))
        self.k = getattr(layer, "k", 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (Bottleneck.send if self.kind == "Bottleneck" else Maxout.send)(self, x)


def split_narrowing(layer: Bottleneck | Maxout) -> tuple[NarrowingSend, nn.Linear]:
    """(sending half, widening ``up`` projection) sharing the layer's modules; copy them to separate them."""
    return NarrowingSend(layer), layer.up


class Bottleneck(nn.Module):
    """LayerNorm(d) -> Linear(d, d/f) -> LayerNorm(d/f) -> [boundary] -> Linear(d/f, d).

    Replaces the residual stream at a stage's end; only the d/f-wide tensor crosses the boundary.
    """

    SEND = ("norm_in", "down", "norm_mid")   # the modules before the boundary

    def __init__(self, hidden: int, factor: int, scheme: str = "none", eps: float = 1e-12):
        super().__init__()
        if factor < 1 or hidden % factor:
            raise ValueError(f"bottleneck factor {factor} must be a positive divisor of the width {hidden}")
        check_scheme(scheme)
        self.scheme = scheme
        self.norm_in = nn.LayerNorm(hidden, eps=eps)
        self.down = nn.Linear(hidden, hidden // factor)
        self.norm_mid = nn.LayerNorm(hidden // factor, eps=eps)
        self.up = nn.Linear(hidden // factor, hidden)

    def send(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_mid(self.down(self.norm_in(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(boundary(self.send(x), self.scheme))


class Maxout(nn.Module):
    """LayerNorm(d) -> max over groups of k channels -> LayerNorm(d/k) -> [boundary] -> Linear(d/k, d).

    The sender side has no parameters besides the norms; only the d/k-wide tensor crosses the boundary.
    """

    SEND = ("norm_in", "norm_mid")   # the modules before the boundary

    def __init__(self, hidden: int, k: int, scheme: str = "none", eps: float = 1e-12):
        super().__init__()
        if k < 1 or hidden % k:
            raise ValueError(f"maxout group size {k} must be a positive divisor of the width {hidden}")
        check_scheme(scheme)
        self.k, self.scheme = k, scheme
        self.norm_in = nn.LayerNorm(hidden, eps=eps)
        self.norm_mid = nn.LayerNorm(hidden // k, eps=eps)
        self.up = nn.Linear(hidden // k, hidden)

    def send(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm_in(x)
        return self.norm_mid(x.view(*x.shape[:-1], x.shape[-1] // self.k, self.k).amax(dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(boundary(self.send(x), self.scheme))
