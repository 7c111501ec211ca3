"""M5 of the swarm_study experiments: compression at stage boundaries vs MLM loss, in one process.

The crammed model split into stages trains once per boundary treatment (a quantisation scheme of
:mod:`cramswarm.swarm.compression`, or a narrowing layer at every boundary), with the same initial weights, batches
and masks, so the loss curves differ by the boundary treatment alone. One CSV (:func:`compression_loss`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from cramswarm.swarm_study.common import torch_threads, write_csv

COMPRESSION_CONFIGS = ("none", "fp16", "blockwise8", "bottleneck2", "maxout2")


class _CompressedPipeline(torch.nn.Module):
    """The stages of a split model run in one process with a compressor between consecutive stages."""

    def __init__(self, stages: list[torch.nn.Module], config: str, hidden: int):
        super().__init__()
        from cramswarm.swarm.compression import SCHEMES, Bottleneck, Maxout

        self.stages = torch.nn.ModuleList(stages)
        self.scheme = config if config in SCHEMES else "none"
        kind = config.rstrip("0123456789")
        if config in SCHEMES:
            links: list[torch.nn.Module] = []
        elif kind in ("bottleneck", "maxout") and config[len(kind):]:
            factor = int(config[len(kind):])
            cls = Bottleneck if kind == "bottleneck" else Maxout
            links = [cls(hidden, factor) for _ in stages[1:]]
        else:
            raise ValueError(f"unknown compression config {config!r}: use a scheme "
                             f"({', '.join(SCHEMES)}) or bottleneck<f> / maxout<k>, e.g. bottleneck2")
        self.links = torch.nn.ModuleList(links)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from cramswarm.swarm.compression import boundary

        x = input_ids
        for index, stage in enumerate(self.stages[:-1]):
            x = stage(x)
            x = self.links[index](x) if self.links else boundary(x, self.scheme)
        return self.stages[-1](x, labels)


def compression_loss(out_csv: str | os.PathLike, blocks_path: str | os.PathLike, *, arch: dict, vocab_size: int,
                     configs: Sequence[str] = COMPRESSION_CONFIGS, stages: int = 2, steps: int = 300,
                     micro_batch: int = 16, lr: float = 1e-3, mask_rate: float = 0.15, weight_decay: float = 0.01,
                     seed: int = 0, threads: int | None = 1) -> Path:
    """M5. Train the crammed MLM model (``arch``, a config ``models.<name>.arch`` section) split into
    ``stages`` stages, in one process, once per compression config: ``none`` / ``fp16`` / ``blockwise8``
    quantise activations forward and gradients backward at every boundary (``compression.boundary``);
    ``bottleneck<f>`` / ``maxout<k>`` insert ``compression.Bottleneck`` / ``Maxout`` at every boundary
    (uncompressed, as the paper's published runs). Same initial weights, batches and masks for every config;
    AdamW at constant ``lr``, bf16 autocast, ``threads`` intra-op threads (see :func:`torch_threads`).

    Columns: config, stages, step, tokens, loss (nats/token).
    """
    blocks = torch.from_numpy(np.load(blocks_path).astype(np.int64))
    if len(blocks) < micro_batch:
        raise ValueError(f"{blocks_path}: {len(blocks)} blocks, fewer than one microbatch of {micro_batch}")
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
    rows = []
    with torch_threads(threads):
        for config in configs:
            rows.extend(_train_compressed(config, blocks, order, arch=arch, vocab_size=vocab_size, stages=stages,
                                          steps=steps, micro_batch=micro_batch, lr=lr, mask_rate=mask_rate,
                                          weight_decay=weight_decay, seed=seed))
    return write_csv(pd.DataFrame(rows), out_csv)


def _train_compressed(config: str, blocks: torch.Tensor, order: torch.Tensor, *, arch: dict, vocab_size: int,
                      stages: int, steps: int, micro_batch: int, lr: float, mask_rate: float, weight_decay: float,
                      seed: int) -> list[dict]:
    """One config's training run of :func:`compression_loss`: one row per step."""
    from cramswarm.swarm.stages import split_model
    from cramswarm.training import build_model, decay_groups, mask_tokens

    model = build_model(arch, vocab_size, seed)
    torch.manual_seed(seed + 1)   # the same compression-layer init for every config
    pipeline = _CompressedPipeline(split_model(model, stages), config, model.config.hidden_size)
    optimizer = torch.optim.AdamW(decay_groups(pipeline, weight_decay), lr=lr)
    generator = torch.Generator().manual_seed(seed)   # the same masks for every config
    rows = []
    for step in range(1, steps + 1):
        batch = blocks[order[torch.arange((step - 1) * micro_batch, step * micro_batch) % len(blocks)]]
        inputs, labels = mask_tokens(batch, mask_rate, "fixed", vocab_size, generator)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pipeline(inputs, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        rows.append({"config": config, "stages": stages, "step": step, "tokens": step * batch.numel(),
                     "loss": loss.item()})
    return rows
