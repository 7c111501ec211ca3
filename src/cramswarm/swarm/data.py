"""Microbatches by index: what each trainer of the launcher's swarm makes for itself (``trainer``).

A source is described by a JSON-able ``spec()`` (the launcher writes it to the run's config; a trainer rebuilds
the source with ``from_spec``) and gives microbatch ``i`` as ``source[i]`` -> (inputs, labels), int64, labels
-100 where a position is not predicted. Microbatch ``i`` depends on ``i`` and the spec only: its masks come from
a generator seeded with ``microbatch_seed(seed, i)``, so the trainer that takes it, a trainer restarted at it and
a rerun resumed at it all make the same masked batch, and no file of microbatches is written before the start
(a seconds budget needs none: the trainers take microbatches until the deadline).

* ``BlockSource`` - the packed training blocks (``.npy``, memory-mapped): microbatch ``i`` holds the rows
  ``[i x micro, (i + 1) x micro)`` of the training blocks, wrapping (sorted, as ``pretrain`` reads them: the same
  blocks single-process pretraining's micro-batch ``i`` holds), masked by ``training.mask_tokens`` (pretraining's
  masking). The masks differ from pretraining's, which draws all micro-batches from one generator in order: the
  same masking, other draws.
* ``CountingSource`` - the tests' and benchmarks' learnable toy language (no tokenizer, no corpus): each sequence
  counts upward through 16 tokens from a random start, 15 % of the positions are masked (the first always), so a
  model's loss falls within a few dozen steps and a swarm run shows whether training happens at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from cramswarm.training import mask_tokens

BOUNDED = 1 << 40  # a run of at least this many microbatches has a seconds budget (time decides, not a count)


def bounded(total: int) -> bool:
    """Whether ``total`` microbatches is a count (token or step budget), not a seconds budget's bound."""
    return total < BOUNDED


def microbatch_seed(seed: int, index: int) -> int:
    """The seed of microbatch ``index``'s masks in a run seeded ``seed`` (64 bits of SHA-256 of both)."""
    return int.from_bytes(hashlib.sha256(f"{int(seed)}:{int(index)}".encode()).digest()[:8], "little")


def generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(microbatch_seed(seed, index))


class BlockSource:
    """Masked microbatches of packed training blocks (see the module docstring)."""

    kind = "blocks"

    def __init__(self, blocks_path: str | Path, n_blocks: int, micro: int, mask_rate: float, mask_mode: str,
                 vocab_size: int, seed: int):
        self.blocks_path = str(Path(blocks_path).resolve())
        self.n_blocks, self.micro, self.mask_rate, self.mask_mode = int(n_blocks), int(micro), mask_rate, mask_mode
        self.vocab_size, self.seed = int(vocab_size), int(seed)
        self._blocks = None
        if not 0 < self.micro <= self.n_blocks:
            raise ValueError(f"a microbatch of {self.micro} blocks does not fit {self.n_blocks} training blocks")

    @classmethod
    def for_recipe(cls, blocks_path, n_blocks: int, recipe: dict, vocab_size: int) -> BlockSource:
        return cls(blocks_path, n_blocks, recipe["micro_batch_sequences"], recipe["mask_rate"], recipe["mask_mode"],
                   vocab_size, recipe["seed"])

    def spec(self) -> dict:
        return {"kind": self.kind, "blocks_path": self.blocks_path, "n_blocks": self.n_blocks, "micro": self.micro,
                "mask_rate": self.mask_rate, "mask_mode": self.mask_mode, "vocab_size": self.vocab_size,
                "seed": self.seed}

    @property
    def blocks(self) -> np.ndarray:
        if self._blocks is None:
            from cramswarm.data.packing import load_blocks

            self._blocks = load_blocks(self.blocks_path)
        return self._blocks

    def rows(self, index: int) -> np.ndarray:
        """The training-block rows of microbatch ``index`` (pretrain's cursor after ``index`` micro-batches)."""
        start = (int(index) * self.micro) % self.n_blocks
        return np.sort(np.arange(start, start + self.micro) % self.n_blocks)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = torch.from_numpy(np.asarray(self.blocks[self.rows(index)], dtype=np.int64))
        return mask_tokens(batch, self.mask_rate, self.mask_mode, self.vocab_size, generator(self.seed, index))


MASK_TOKEN = 4  # ids 0-4 are the tokenizer's specials in the tiny test vocabulary; the language uses 5-20
FIRST_TOKEN, PERIOD = 5, 16


def counting_microbatches(micro: int, seq_len: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, labels) microbatches of ``micro`` sequences of ``seq_len`` tokens; labels are -100 where
    a position is not masked. The same ``seed`` gives the same stream."""
    return _counting(micro, seq_len, torch.Generator().manual_seed(seed))


def _counting(micro: int, seq_len: int, g: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        start = torch.randint(0, PERIOD, (micro, 1), generator=g)
        tokens = FIRST_TOKEN + (start + torch.arange(seq_len)) % PERIOD
        masked = torch.rand(micro, seq_len, generator=g) < 0.15
        masked[:, 0] = True
        labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
        yield torch.where(masked, torch.full_like(tokens, MASK_TOKEN), tokens), labels


class CountingSource:
    """The toy language by microbatch index (for the launcher's trainers): microbatch ``i`` is drawn from a
    generator seeded with ``microbatch_seed(seed, i)``."""

    kind = "counting"

    def __init__(self, micro: int, seq_len: int, seed: int = 0):
        self.micro, self.seq_len, self.seed = int(micro), int(seq_len), int(seed)

    def spec(self) -> dict:
        return {"kind": self.kind, "micro": self.micro, "seq_len": self.seq_len, "seed": self.seed}

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return next(_counting(self.micro, self.seq_len, generator(self.seed, index)))


def from_spec(spec: dict):
    """The source a ``spec()`` describes."""
    fields = {k: v for k, v in spec.items() if k != "kind"}
    if spec["kind"] == BlockSource.kind:
        return BlockSource(**fields)
    if spec["kind"] == CountingSource.kind:
        return CountingSource(**fields)
    raise ValueError(f"unknown microbatch source {spec['kind']!r}")


def is_source(obj) -> bool:
    """Whether ``obj`` is a microbatch source (indexable, with a spec), not an iterator of microbatches."""
    return hasattr(obj, "spec") and hasattr(obj, "__getitem__")


def fingerprint(source, total: int) -> str:
    """SHA-1 of a source's first and (for a count) last microbatch: a rerun must make the same data."""
    digest = hashlib.sha1()
    for index in sorted({0, total - 1 if bounded(total) else 0}):
        for tensor in source[index]:
            digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()
