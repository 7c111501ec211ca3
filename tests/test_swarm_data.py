"""Microbatches by index (``cramswarm.swarm.data``): what the launcher's trainers make for themselves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cramswarm.swarm import data
from cramswarm.swarm.data import CountingSource
from cramswarm.swarm.train import microbatches
from cramswarm.training import mask_tokens

VOCAB, MICRO, LENGTH, N_BLOCKS = 64, 4, 16, 10


@pytest.fixture
def blocks_path(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "blocks.npy"
    np.save(path, rng.integers(5, VOCAB, size=(N_BLOCKS + 3, LENGTH), dtype=np.int32))  # 3 held-out rows
    return path


def recipe(**kw) -> dict:
    return {"micro_batch_sequences": MICRO, "mask_rate": 0.25, "mask_mode": "bernoulli", "seed": 3} | kw


def test_microbatch_i_holds_pretrainings_blocks_and_is_masked_by_pretrainings_masking(blocks_path):
    source = data.BlockSource.for_recipe(blocks_path, N_BLOCKS, recipe(), VOCAB)
    blocks = np.load(blocks_path)
    sequential = microbatches(blocks, N_BLOCKS, recipe(), VOCAB)
    for i in range(7):  # past the wrap of the 10 training blocks (microbatch 2 holds rows 8, 9, 0, 1)
        inputs, labels = source[i]
        seq_inputs, seq_labels = next(sequential)
        rows = source.rows(i)
        assert rows.tolist() == sorted((i * MICRO + k) % N_BLOCKS for k in range(MICRO))
        # the same blocks as single-process pretraining's micro-batch i: the unmasked positions and the labels show
        block = torch.from_numpy(blocks[rows].astype(np.int64))
        assert torch.equal(torch.where(labels == -100, inputs, labels), block)
        assert torch.equal(torch.where(seq_labels == -100, seq_inputs, seq_labels), block)
        # the masking is training.mask_tokens, drawn from the microbatch's own generator
        expected = mask_tokens(block, 0.25, "bernoulli", VOCAB, data.generator(3, i))
        assert all(torch.equal(a, b) for a, b in zip((inputs, labels), expected))
        assert (labels != -100).any() and inputs.dtype == labels.dtype == torch.int64
    assert not set(source.rows(9).tolist()) & set(range(N_BLOCKS, N_BLOCKS + 3))  # never a held-out block


def test_microbatches_are_the_same_whoever_makes_them_in_whatever_order(blocks_path):
    """A trainer restarted at microbatch k (a fresh process: the source rebuilt from its spec) makes the same
    masked batch k as the trainer that made it first, after any other microbatches."""
    first = data.BlockSource.for_recipe(blocks_path, N_BLOCKS, recipe(), VOCAB)
    made = {i: first[i] for i in range(12)}
    again = data.from_spec(first.spec())
    for i in [11, 5, 0, 7, 5]:
        assert all(torch.equal(a, b) for a, b in zip(again[i], made[i])), i
    # other microbatches, other seeds and other masking settings draw other masks
    assert not torch.equal(made[0][1], made[5][1])  # rows 0-3 again at microbatch 5: other positions masked
    other_seed = data.BlockSource.for_recipe(blocks_path, N_BLOCKS, recipe(seed=4), VOCAB)
    assert not torch.equal(other_seed[0][1], made[0][1])
    assert data.fingerprint(again, 12) == data.fingerprint(first, 12) != data.fingerprint(other_seed, 12)
    assert len({data.microbatch_seed(s, i) for s in range(3) for i in range(3)}) == 9


def test_toy_source_by_index_and_the_spec_round_trip():
    toy = CountingSource(MICRO, LENGTH, seed=1)
    assert data.is_source(toy) and not data.is_source(iter([]))
    rebuilt = data.from_spec(toy.spec())
    assert all(torch.equal(a, b) for a, b in zip(rebuilt[4], toy[4]))
    assert not torch.equal(toy[4][0], toy[5][0])
    with pytest.raises(ValueError, match="unknown microbatch source 'tape'"):
        data.from_spec({"kind": "tape"})
    with pytest.raises(ValueError, match="does not fit 3 training blocks"):
        data.BlockSource("blocks.npy", 3, MICRO, 0.15, "fixed", VOCAB, 0)


def test_a_seconds_budget_is_unbounded():
    from cramswarm.swarm.train import UNBOUNDED

    assert data.bounded(10**9) and not data.bounded(UNBOUNDED)
