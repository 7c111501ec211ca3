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

The codec lives in :mod:`cramswarm.codec` and the narrowing layers (``Bottleneck``, ``Maxout``) in
:mod:`cramswarm.models.narrowing`; this module names what ``swarm.compression`` accepts and what travels.

Swarm training (``swarm.compression``) takes a scheme or a narrowing layer, ``bottleneck2``/``bottleneck4``/
``maxout2``/``maxout4`` (``COMPRESSIONS``; the digit is the factor): the model then holds one such layer at
the end of every stage but the last (``CrammedBertConfig.boundary_*``), split in two halves
(:func:`split_narrowing`): the sending stage ends with the narrowing half (:class:`NarrowingSend`) and the next
stage starts with the widening ``up`` projection, so the narrowed tensor (and its gradient) is what travels,
in fp32 (:func:`wire_scheme`).
"""

from __future__ import annotations

from cramswarm.codec import (  # noqa: F401 (the codec's names, as the swarm modules and tests import them here)
    SCHEMES,
    Boundary,
    boundary,
    check_scheme,
    decode,
    encode,
    payload_bytes,
    payload_to,
    roundtrip,
)
from cramswarm.models.narrowing import (  # noqa: F401 (the narrowing layers, as above)
    Bottleneck,
    Maxout,
    NarrowingSend,
    make_narrowing,
    split_narrowing,
)

NARROWING = {"bottleneck2": ("bottleneck", 2), "bottleneck4": ("bottleneck", 4), "maxout2": ("maxout", 2),
             "maxout4": ("maxout", 4)}
COMPRESSIONS = SCHEMES + tuple(NARROWING)  # what swarm.compression accepts


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
