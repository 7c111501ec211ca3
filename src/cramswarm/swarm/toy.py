"""A learnable toy language for the swarm's tests and benchmarks (no tokenizer, no corpus): each sequence counts
upward through 16 tokens from a random start, 15 % of the positions are masked (the first always), so a model's
loss falls within a few dozen steps and a swarm run shows whether training happens at all."""

from __future__ import annotations

from collections.abc import Iterator

import torch

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
    """The toy language by microbatch index (a ``cramswarm.swarm.data`` source, for the launcher's trainers):
    microbatch ``i`` is drawn from a generator seeded with ``data.microbatch_seed(seed, i)``."""

    kind = "counting"

    def __init__(self, micro: int, seq_len: int, seed: int = 0):
        self.micro, self.seq_len, self.seed = int(micro), int(seq_len), int(seed)

    def spec(self) -> dict:
        return {"kind": self.kind, "micro": self.micro, "seq_len": self.seq_len, "seed": self.seed}

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        from cramswarm.swarm.data import generator

        return next(_counting(self.micro, self.seq_len, generator(self.seed, index)))
