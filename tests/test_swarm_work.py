"""The trainers' leases as pure rules (``cramswarm.swarm.work``): which lease a trainer takes from the claim records,
when it gives one up, when the work is done, and the order a resumed run owes. The leases on real processes are in
test_swarm_launcher.py (trainers added and removed mid-run)."""

from __future__ import annotations

import random

import pytest

from cramswarm.swarm.work import WAIT, Claim, Work, WorkOrder, all_done, next_work, yields_to

STALE = 20.0


def working(lease: int, nxt: int, beat: float = 100.0, size: int = 4, top: int | None = None) -> Claim:
    return Claim(lease, nxt, lease * size + size, lease if top is None else top, beat, "working")


def test_a_fresh_run_hands_out_leases_in_order_and_a_short_last_one():
    assert next_work({}, "0", 100.0, positions=10) == Work(0, 0, 4)
    claims = {"0": working(0, 1), "1": working(1, 4)}
    assert next_work(claims, "2", 100.0, positions=10) == Work(2, 8, 10)   # the last lease holds what is left
    claims["2"] = Claim(2, 8, 10, 2, 100.0, "working")
    assert next_work(claims, "3", 100.0, positions=10) == WAIT   # nothing fresh: others' leases may still die
    done = {name: Claim(c.lease, c.end, c.end, c.top, c.beat, c.state) for name, c in claims.items()}
    assert next_work(done, "3", 100.0, positions=10) is None and all_done(done, positions=10)
    assert not all_done(claims, positions=10)


def test_a_trainer_restarted_under_its_name_goes_on_with_its_lease():
    claims = {"0": working(3, 14, beat=0.0), "1": working(4, 16)}
    assert next_work(claims, "0", 100.0, positions=100) == Work(3, 14, 16)   # its own, stale or not


def test_a_dead_trainers_unfinished_lease_is_adopted_before_any_fresh_one_and_only_once():
    claims = {"0": working(5, 21, beat=100.0 - STALE - 1), "1": working(6, 24, top=9)}
    assert next_work(claims, "2", 100.0, positions=100) == Work(5, 21, 24, adopted_from="0")
    claims["2"] = working(5, 21)        # adopted: the orphan is held by a live claim now
    assert next_work(claims, "3", 100.0, positions=100) == Work(10, 40, 44)  # after the highest lease any took
    adopted = dict(claims, **{"0": Claim(5, 21, 24, 5, 0.0, "adopted")})
    assert next_work(adopted, "3", 200.0, positions=100) != Work(5, 21, 24, adopted_from="0")


def test_a_released_lease_is_adopted_at_once_and_a_finished_one_never():
    claims = {"0": Claim(2, 9, 12, 2, 100.0, "released"), "1": Claim(1, 8, 8, 3, 0.0, "working")}
    assert next_work(claims, "1", 100.0, positions=100) == Work(2, 9, 12, adopted_from="0")
    assert not all_done(claims, positions=16)   # a released lease is unfinished
    claims["0"] = Claim(2, 12, 12, 2, 100.0, "released")
    assert next_work(claims, "1", 100.0, positions=16) is None   # finished, dead trainer or not


def test_of_two_trainers_on_one_lease_the_later_name_yields_and_a_dead_rival_does_not_count():
    claims = {"0": working(4, 17), "j5": working(4, 16)}
    assert yields_to(claims, "j5", 100.0) == "0" and yields_to(claims, "0", 100.0) is None
    claims["0"] = working(4, 17, beat=0.0)   # stale: j5 keeps the lease
    assert yields_to(claims, "j5", 100.0) is None


def test_garbage_records_are_no_claims():
    assert Claim.from_value({"lease": 1}) is None and Claim.from_value("x") is None
    assert Claim.from_value({**working(1, 9).value(), "state": "mine"}) is None
    assert Claim.from_value({**working(1, 9).value(), "next": 99}) is None   # past its end
    assert Claim.from_value(working(1, 5).value()) == working(1, 5)


def test_a_resumed_order_owes_the_gaps_first_then_goes_on_after_the_last_finished():
    order = WorkOrder.after(20, {0, 1, 2, 4, 7})
    assert order.holes == (3, 5, 6) and order.start == 8 and order.positions == 3 + 12
    assert [order.index(p) for p in range(order.positions)] == [3, 5, 6, *range(8, 20)]
    assert WorkOrder.from_spec(20, order.spec()) == order and WorkOrder.from_spec(20, None) == WorkOrder(20)
    with pytest.raises(IndexError):
        order.index(order.positions)
    assert WorkOrder.after(20, set(range(20))).positions == 0


@pytest.mark.parametrize("seed", range(5))
def test_trainers_that_come_and_go_at_random_train_every_position_at_least_once(seed):
    """A simulated swarm of trainers on the rules alone: each step one trainer acts (takes work, trains one
    position, dies, or leaves deliberately), its record renewed while it lives; new trainers join. Every position
    of the order is trained, and the duplicates are few (at least once, not exactly once)."""
    rng, positions, now = random.Random(seed), 57, 0.0
    claims: dict[str, Claim] = {}
    alive: dict[str, None] = {"0": None, "1": None}
    trained: list[int] = []
    joined = 2
    while True:
        now += 1.0
        for name in alive:   # the live ones renew
            if name in claims:
                claims[name] = Claim(**{**claims[name].value(), "beat": now})
        if rng.random() < 0.03:
            joined += 1
            alive[f"j{joined}"] = None
        name = rng.choice(sorted(alive))
        if rng.random() < 0.02 and len(alive) > 1:   # dies: its record goes stale
            del alive[name]
            continue
        if rng.random() < 0.02 and len(alive) > 1:   # leaves: releases its lease
            if name in claims:
                claims[name] = Claim(**{**claims[name].value(), "state": "released"})
            del alive[name]
            continue
        mine = claims.get(name)
        if mine is None or not mine.unfinished or mine.state != "working":
            work = next_work(claims, name, now, positions=positions, stale_s=STALE)
            if work is None:
                if all_done(claims, positions=positions):
                    break
                continue
            if work == WAIT:
                continue
            if work.adopted_from is not None:
                claims[work.adopted_from] = Claim(**{**claims[work.adopted_from].value(), "state": "adopted"})
            top = max(mine.top if mine else -1, work.lease)
            claims[name] = Claim(work.lease, work.next, work.end, top, now, "working")
            continue
        trained.append(mine.next)
        claims[name] = Claim(mine.lease, mine.next + 1, mine.end, mine.top, now, "working")
        assert now < 10_000, "the rules never finished the work"
    assert set(trained) == set(range(positions))
    assert len(trained) - positions <= 8, len(trained) - positions
