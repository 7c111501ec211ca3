"""What ``swarm.compression`` accepts for the tensors that cross a pipeline-stage boundary (activations forward,
gradients backward), and what travels.

Swarm training takes a scheme of the codec (:mod:`cramswarm.codec`: ``none``, ``fp16``, ``blockwise8``) or a
narrowing layer (:mod:`cramswarm.models.narrowing`), ``bottleneck2``/``bottleneck4``/``maxout2``/``maxout4``
(``COMPRESSIONS``; the digit is the factor): the model then holds one such layer at the end of every stage but the
last (``CrammedBertConfig.boundary_*``), split in two halves (:func:`split_narrowing`): the sending stage ends with
the narrowing half (``models.narrowing.NarrowingSend``) and the next stage starts with the widening ``up`` projection,
so the narrowed tensor (and its gradient) is what travels, in fp32 (:func:`wire_scheme`). The codec's and the layers'
names the swarm modules and tests use are re-exported here.
"""

from __future__ import annotations

from cramswarm.codec import (  # noqa: F401 (the codec's names, as the swarm modules and tests import them here)
    SCHEMES,
    boundary,
    decode,
    encode,
    payload_bytes,
    payload_to,
    roundtrip,
)
from cramswarm.models.narrowing import (  # noqa: F401 (the narrowing layers, as above)
    Bottleneck,
    Maxout,
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
