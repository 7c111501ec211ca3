"""Transport 1 (real hivemind processes on localhost): fault tolerance, in-stage sync, bootstrap errors, clean-up."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("hivemind", reason="hivemind is not installed: transport 1 (real hivemind processes) is untested")

from conftest import ARCH, recipe  # noqa: E402

from cramswarm.swarm import hivemind_transport as ht  # noqa: E402
from cramswarm.swarm.hivemind_peer import BootstrapError  # noqa: E402
from cramswarm.swarm.policies import NoPeersError, RetryPolicy  # noqa: E402

TINY = ARCH | dict(layers=2, hidden_size=64, heads=2, intermediate_size=128, max_positions=32)
VOCAB, MICRO, SEQ = 128, 4, 32
# A well-formed multiaddr of a peer that does not exist (nothing listens on port 1).
NOWHERE = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWEpV7iEfzTwJ4NkkVYcuRhqCVNppEeuuE5eAqRXZUePKk"


def batches(seed: int = 0):
    """Masked microbatches of a learnable language: each sequence counts upward through 16 tokens."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, 16, (MICRO, 1), generator=g)
        tokens = 5 + (start + torch.arange(SEQ)) % 16
        masked = torch.rand(MICRO, SEQ, generator=g) < 0.15
        masked[:, 0] = True
        labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
        yield torch.where(masked, torch.full_like(tokens, 4), tokens), labels


def plan(**kw) -> ht.SwarmPlan:
    base = dict(arch=TINY, vocab_size=VOCAB, peers_per_stage=[2, 2], trainers=2, compression="blockwise8",
                recipe=recipe(micro_batch_sequences=MICRO, batch_sequences=4 * MICRO, lr=3e-3, batch_ramp_fraction=0.0,
                              budget={"unit": "steps", "value": 1000}),
                retry=RetryPolicy(forward_timeout_s=5.0, give_up_after_s=30.0), startup_timeout_s=120.0)
    return ht.SwarmPlan(**(base | kw))


def own_p2p_daemons() -> list[int]:
    return sorted(ht._own_daemons())


@pytest.mark.slow
def test_sigkill_of_peers_mid_run_loses_no_microbatch_and_rejoined_peers_load_the_state():
    total = 480
    daemons_before = own_p2p_daemons()
    result = ht.run_swarm(plan(peer_speeds=[0.25], kill_every_s=3.0, rejoin_after_s=0.2), batches(), total,
                          progress=False)
    stats = result.stats
    # every microbatch requested was completed (re-sent to another replica when its peer died)
    assert stats["microbatches_requested"] == stats["microbatches_done"] == total
    assert stats["lost_microbatches"] == 0
    assert stats["peers_killed"] >= 1 and stats["rejoins"] >= 1, stats
    # loss keeps falling through the failures (one log row per optimizer step of the last stage; a kill loses at
    # most the victim's unaveraged gradients, i.e. at most one step's worth)
    losses = [row["loss"] for row in result.log]
    assert stats["steps"] == total // 4 and len(losses) >= stats["steps"] - stats["peers_killed"], len(losses)
    assert stats["rollbacks"] == []
    early, late = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert late < early - 0.5, (early, late)
    # a restarted peer (uid beyond the 4 initial ones) downloaded the state and took the same steps since:
    # all live replicas of each stage hold identical parameters at the end
    replicas = stats["replica_steps"]
    restarted = [uid for steps in replicas.values() for uid in steps if int(uid.split("p")[1]) > 4]
    assert restarted, replicas
    assert stats["replicas_equal"] and stats["replica_max_abs_diff"] == [0.0, 0.0], replicas
    assert all(len(set(steps.values())) == 1 for steps in replicas.values()), replicas
    assert len(result.stage_states) == 2 and all(result.stage_states) and result.log
    # nothing outlives the run: no member of any process group it started, no p2pd of this process
    assert ht.leftover_processes(stats["process_groups"]) == []
    assert own_p2p_daemons() == daemons_before


@pytest.mark.slow
def test_rebalancing_moves_a_peer_from_the_over_provisioned_stage():
    result = ht.run_swarm(plan(peers_per_stage=[3, 1], trainers=3, peer_speeds=[0.4], rebalance_period_s=3.0),
                          batches(), 200, progress=False)
    stats = result.stats
    assert [(m["from_stage"], m["to_stage"]) for m in stats["moves"]][:1] == [(0, 1)], stats["moves"]
    assert stats["lost_microbatches"] == 0 and stats["microbatches_done"] == 200
    assert stats["replicas_equal"], stats["replica_steps"]
    assert ht.leftover_processes(stats["process_groups"]) == []


def test_unreachable_or_garbage_bootstrap_fails_fast_with_a_clear_error(tmp_path):
    addr_file = tmp_path / "dht_addrs.txt"
    addr_file.write_text(NOWHERE + "\n")
    started = time.monotonic()
    with pytest.raises(BootstrapError, match="could not join the swarm DHT"):
        ht.run_swarm(plan(addr_file=addr_file, join_timeout_s=5.0), batches(), 4, progress=False)
    assert time.monotonic() - started < 20
    addr_file.write_text("not-a-multiaddr\n")
    with pytest.raises(BootstrapError, match="no valid multiaddr"):
        ht.run_swarm(plan(addr_file=addr_file, join_timeout_s=5.0), batches(), 4, progress=False)
    with pytest.raises(BootstrapError, match="did not appear"):
        ht.run_swarm(plan(addr_file=tmp_path / "missing.txt", join_timeout_s=1.0), batches(), 4, progress=False)
    # a stage peer pointed at an unreachable bootstrap exits with the same clear error
    addr_file.write_text(NOWHERE + "\n")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"join_timeout_s": 5.0, "host": "127.0.0.1"}))
    proc = subprocess.run([sys.executable, "-m", "cramswarm.swarm.hivemind_peer", "stage", "--config", str(config),
                           "--stage", "0", "--uid", "s0p1", "--addr-file", str(addr_file)],
                          capture_output=True, text=True, timeout=90, start_new_session=True)
    assert proc.returncode == 2 and "could not join the swarm DHT" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_a_stage_without_peers_raises_no_peers_error_naming_it_within_the_bound(monkeypatch):
    daemons_before = own_p2p_daemons()
    swarm = plan(peers_per_stage=[1, 0], trainers=1, retry=RetryPolicy(forward_timeout_s=5.0, give_up_after_s=2.0))
    coordinators = []
    original = ht.Coordinator.__init__

    def remember(self, *args, **kwargs):
        original(self, *args, **kwargs)
        coordinators.append(self)

    monkeypatch.setattr(ht.Coordinator, "__init__", remember)
    with pytest.raises(NoPeersError, match="stage 1") as error:
        ht.run_swarm(swarm, batches(), 8, progress=False)
    assert error.value.stage == 1
    assert coordinators[0].elapsed() < 30  # training clock: from the swarm being up to the error
    assert ht.leftover_processes(coordinators[0].groups.pgids) == []
    assert own_p2p_daemons() == daemons_before
