"""Compression of the tensors that cross a pipeline-stage boundary (activations forward, gradients backward).

Schemes (``SCHEMES``):

* ``none``       - fp32 as is;
* ``fp16``       - half precision (2 bytes per value);
* ``blockwise8`` - blockwise absmax 8-bit: the flattened tensor is cut into blocks of ``block_size`` values;
                   each block is scaled by its absolute maximum and rounded to a symmetric linear code
                   (-127..127, stored as uint8 with offset 128), plus one fp32 absmax per block (~1 byte per
                   value). Scaling per block keeps outlier channels of LayerNorm'd transformer activations
                   representable, where one per-tensor clipped code destroys them (swarm.md 2.1). This is a
                   pure-torch linear code, not bitsandbytes' dynamic (non-uniform) code.

``Boundary`` quantises in the forward pass and quantises the incoming gradient in the backward pass, i.e. it
simulates a stage boundary inside one process. ``Bottleneck`` and ``Maxout`` are SWARM's compression-aware
layers (swarm.md 2.2): only a narrower tensor crosses the boundary.

Swarm training (``swarm.compression``) takes a scheme or a narrowing layer, ``bottleneck2``/``bottleneck4``/
``maxout2``/``maxout4`` (``COMPRESSIONS``; the digit is the factor): the model then holds one such layer at
the end of every stage but the last (``CrammedBertConfig.boundary_*``), split in two halves
(:func:`split_narrowing`): the sending stage ends with the narrowing half (:class:`NarrowingSend`) and the next
stage starts with the widening ``up`` projection, so the narrowed tensor (and its gradient) is what travels,
in fp32 (:func:`wire_scheme`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

SCHEMES = ("none", "fp16", "blockwise8")
NARROWING = {"bottleneck2": ("bottleneck", 2), "bottleneck4": ("bottleneck", 4), "maxout2": ("maxout", 2),
             "maxout4": ("maxout", 4)}
COMPRESSIONS = SCHEMES + tuple(NARROWING)  # what swarm.compression accepts
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def _check(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown compression scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")


def _step(absmax: torch.Tensor) -> torch.Tensor:
    """absmax / 127, the value of one code step, rounded alike on every device: the divisor is a tensor on
    ``absmax``'s device, because CUDA divides by a Python number as a multiplication by its reciprocal (1 ulp
    off for some blocks, which flips the codes of values near a rounding boundary; seen on an H200)."""
    return absmax / absmax.new_tensor(127.0)


def encode(t: torch.Tensor, scheme: str, *, block_size: int = 4096) -> dict:
    """The payload that would travel over the network: tensors plus shape/dtype metadata, on ``t``'s device (a
    peer encodes where it computed and moves only the payload)."""
    _check(scheme)
    payload = {"scheme": scheme, "shape": tuple(t.shape), "dtype": str(t.dtype)}
    flat = t.detach().reshape(-1)
    if scheme == "none":
        payload["values"] = flat.float().clone()
    elif scheme == "fp16":
        payload["values"] = flat.to(torch.float16)
    else:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        flat = flat.float()
        numel = flat.numel()
        blocks = math.ceil(numel / block_size) if numel else 0
        if blocks * block_size == numel:   # whole blocks: a view, no padded copy (never written to)
            padded = flat.view(blocks, block_size)
        else:
            padded = flat.new_zeros(blocks * block_size)
            padded[:numel] = flat
            padded = padded.view(blocks, block_size)
        low, high = torch.aminmax(padded, dim=1) if blocks else (padded.sum(1), padded.sum(1))
        absmax = torch.maximum(high, -low)   # max |x| per block, without an |x| copy of the tensor
        scale = torch.where(absmax > 0, _step(absmax), torch.ones_like(absmax))
        # round(x / scale) in [-127, 127], + 128: one new tensor, the rest in place (the same values as out of place)
        codes = (padded / scale[:, None]).round_().clamp_(-127, 127).add_(128)
        # only the tensor's own codes travel (the last block's zero padding is restored on decode)
        codes = codes.to(torch.uint8).reshape(-1)
        payload.update(codes=codes[:numel].clone() if codes.numel() != numel else codes, absmax=absmax,
                       block_size=block_size)
    return payload


def decode(payload: dict) -> torch.Tensor:
    """The tensor a payload carries, on the payload's device."""
    dtype, shape = _DTYPES[payload["dtype"]], payload["shape"]
    if payload["scheme"] == "blockwise8":
        numel, size = math.prod(shape), payload["block_size"]
        absmax = payload["absmax"]
        if absmax.numel() * size == numel:
            codes = payload["codes"].float()
        else:
            codes = torch.full((absmax.numel() * size,), 128.0, device=absmax.device)
            codes[:numel] = payload["codes"].float()
        values = codes.view(-1, size).sub_(128.0).mul_(_step(absmax)[:, None]).reshape(-1)
        return values[:numel].reshape(shape).to(dtype)
    return payload["values"].reshape(shape).to(dtype)


def payload_to(payload: dict, device: torch.device | str) -> dict:
    """The payload with its tensors on ``device`` (metadata as is)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in payload.items()}


def payload_bytes(payload: dict) -> int:
    """Bytes of the payload's tensors (shape and dtype metadata are a few bytes and not counted)."""
    return sum(v.numel() * v.element_size() for v in payload.values() if isinstance(v, torch.Tensor))


def roundtrip(t: torch.Tensor, scheme: str) -> torch.Tensor:
    """``decode(encode(t))``: what the receiver sees."""
    return decode(encode(t, scheme))


class Boundary(torch.autograd.Function):
    """Identity up to compression: quantise->dequantise activations forward, gradients backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scheme: str) -> torch.Tensor:
        ctx.scheme = scheme
        return roundtrip(x, scheme)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return roundtrip(grad, ctx.scheme), None


def boundary(x: torch.Tensor, scheme: str) -> torch.Tensor:
    _check(scheme)
    return x if scheme == "none" else Boundary.apply(x, scheme)


def narrowing(compression: str) -> tuple[str, int] | None:
    """(kind, factor) of a narrowing ``swarm.compression`` (``bottleneck2`` -> ("bottleneck", 2)); None for a
    scheme; ValueError for anything else."""
    if compression in NARROWING:
        return NARROWING[compression]
    if compression in SCHEMES:
        return None
    raise ValueError(f"unknown compression {compression!r}; allowed: {', '.join(COMPRESSIONS)}")


def wire_scheme(compression: str) -> str:
    """The scheme the boundary tensors travel in: the scheme itself, fp32 (``none``) for a narrowing layer."""
    return "none" if narrowing(compression) else compression


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
        _check(scheme)
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
        _check(scheme)
        self.k, self.scheme = k, scheme
        self.norm_in = nn.LayerNorm(hidden, eps=eps)
        self.norm_mid = nn.LayerNorm(hidden // k, eps=eps)
        self.up = nn.Linear(hidden // k, hidden)

    def send(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm_in(x)
        return self.norm_mid(x.view(*x.shape[:-1], x.shape[-1] // self.k, self.k).amax(dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(boundary(self.send(x), self.scheme))
