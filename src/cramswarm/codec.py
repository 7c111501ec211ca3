"""Compression of the tensors that cross a pipeline-stage boundary (activations forward, gradients backward): the
codec, below both the model (whose narrowing layers quantise at their boundary) and the SWARM package (whose
peers send the payloads).

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
simulates a stage boundary inside one process.
"""

from __future__ import annotations

import math

import torch

SCHEMES = ("none", "fp16", "blockwise8")
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def check_scheme(scheme: str) -> None:
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
    check_scheme(scheme)
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
    check_scheme(scheme)
    return x if scheme == "none" else Boundary.apply(x, scheme)
