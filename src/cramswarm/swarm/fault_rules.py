"""Fault injection's pure rules (no I/O, no clock): which replicas a fault may take.

* ``kill_candidates`` - the replicas a random kill may take, one rule for the launcher and the emulation: never a
  stage's last up-to-date copy.
* ``parse_gone`` / ``gone_victims`` - the launcher's ``gone<N>:stage<S>`` fault target: N peers of a stage killed
  for good, never the last one at the stage's latest step.
* ``parse_join`` / ``join_entry`` - the launcher's ``join`` fault target: a new peer that joins the running swarm
  through one live entry of its address file and picks its stage itself.
"""

from __future__ import annotations

import re
from collections.abc import Container, Mapping


def kill_candidates(steps: Mapping[int, Mapping[str, int]], live: Container[str]) -> list[str]:
    """Fault injection's victims, one rule for the launcher and the emulation: ``steps`` gives per stage the step
    each replica's record shows (dead ones too, until their records expire), ``live`` the uids that may be killed
    (alive, not moving, not already killed). A live replica may be killed if it is at its stage's latest step and
    at least one other live replica is too, so a kill never takes the last up-to-date copy of a stage. In the order
    given (the caller's random choice depends on it)."""
    found = []
    for replicas in steps.values():
        latest = max(replicas.values(), default=0)
        current = [uid for uid, step in replicas.items() if step == latest and uid in live]
        if len(current) >= 2:
            found.extend(current)
    return found


GONE_TARGET = re.compile(r"gone(\d+):stage(\d+)")


def parse_gone(target: str) -> tuple[int, int] | None:
    """(peers, stage) of a ``gone<N>:stage<S>`` fault target (N >= 1), None for any other target."""
    match = GONE_TARGET.fullmatch(target)
    if match is None:
        return None
    count, stage = int(match.group(1)), int(match.group(2))
    if count < 1:
        raise ValueError(f"fault target {target!r}: kill at least one peer (gone1:stage<S> or more)")
    return count, stage


def gone_victims(steps: dict[str, int], count: int) -> list[str]:
    """Which of a stage's live peers (uid -> its latest step, -1 without a progress record) a ``gone<N>:stage<S>``
    fault kills: ``count`` of them, never the last one at the stage's latest step (the stage's state must stay
    downloadable), so at most all but one; the furthest behind first, then by uid."""
    if not steps:
        return []
    latest = max(steps.values())
    keep = min(u for u, step in steps.items() if step == latest)
    others = sorted((u for u in steps if u != keep), key=lambda u: (steps[u], u))
    return others[:count]


JOIN_TARGET = re.compile(r"join(?::(\d+(?:\.\d*)?|\.\d+))?")


def parse_join(target: str) -> float | None:
    """The speed of a ``join`` (speed 1) or ``join:<speed>`` fault target (speed > 0), None for any other target."""
    match = JOIN_TARGET.fullmatch(target)
    if match is None:
        return None
    speed = float(match.group(1)) if match.group(1) is not None else 1.0
    if not speed > 0:
        raise ValueError(f"fault target {target!r}: a joining peer's speed must be positive")
    return speed


def join_entry(maddrs: list[str], live_ids: Container[str], bootstrap_alive: bool) -> str | None:
    """The address file's entry (``maddrs``, in file order: the bootstrap's first, then each process's as it
    joined) a ``join`` fault gives its new peer: the newest whose ``/p2p/<id>`` is one of ``live_ids`` (the P2P
    ids of the stages' declared peers), else the bootstrap's first entry while it is alive, else None (no entry
    is known to be live)."""
    for maddr in reversed(maddrs):
        _, _, peer_id = maddr.rpartition("/p2p/")
        if peer_id and peer_id in live_ids:
            return maddr
    return maddrs[0] if maddrs and bootstrap_alive else None
