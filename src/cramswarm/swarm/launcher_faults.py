"""A launcher's fault injection (``launcher``, mixed into ``Launcher`` as ``FaultInjection``): ``kill_every_s``
(SIGKILL of a random killable stage peer, ``fault_rules.kill_candidates``; with the attach placement the peer's
``die`` RPC, and its task restarts it) and the plan's ``faults`` (SIGKILL of named processes at given times,
``gone<N>:stage<S>`` for good, or the placement's own faults) and ``join`` / ``join:<speed>`` (a new peer that joins
the running swarm by ``swarm-join``). It only kills and adds; the supervisor restarts."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time

from cramswarm.swarm.fault_rules import gone_victims, join_entry, kill_candidates, parse_gone, parse_join
from cramswarm.swarm.membership import read_addr_file, stage_records
from cramswarm.swarm.processes import SUPERVISE_PERIOD_S, PeerProcess
from cramswarm.swarm.progress import progress_records
from cramswarm.swarm.wire import request, unpack

JOIN_COMMAND = [sys.executable, "-m", "cramswarm", "swarm-join"]
JOINED_LINE = re.compile(r"\[(s\d+q\d+)\] joined swarm")   # serve_joined's line naming the joiner's uid


def rank_of_uid(uid: str) -> int | None:
    """The rank in a ``swarm-peer`` task's uid (``s<stage>r<rank>.<incarnation>``); None for local peers."""
    head, _, rest = uid.partition("r")
    return int(rest.split(".")[0]) if rest and head.startswith("s") and "." in rest else None


class FaultInjection:
    """``Launcher``'s faults: it uses the launcher's ``plan``, ``node``, ``run_id``, ``rng``, ``peers``, ``retired``,
    ``trainers``, ``finished``, ``bootstrap``, ``groups``, ``place``, ``stats``, ``elapsed``, ``_spawn``,
    ``_restart_peer``, ``_stage_stub``, ``_done_microbatches``, ``addr_file`` and ``host``."""

    async def _killable(self) -> list[PeerProcess]:
        """Live peers of stages where at least two live replicas are at the stage's latest step
        (``fault_rules.kill_candidates``, the emulation's rule too)."""
        steps = {stage: {u: r.step for u, r in (await progress_records(self.node, self.run_id, stage)).items()}
                 for stage in range(self.plan.stages)}
        live = {u for u, peer in self.peers.items() if peer.alive and u not in self.retired}
        return [self.peers[u] for u in kill_candidates(steps, live)]

    def _kill_peer(self, peer: PeerProcess) -> None:
        self.retired.add(peer.uid)
        self.groups.kill(peer.proc)
        self.stats["peers_killed"] += 1
        self.stats["killed"].append({"uid": peer.uid, "stage": peer.stage, "t_s": round(self.elapsed(), 2)})
        self._spawn(self._restart_peer(peer))

    async def _kill_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            if self.plan.placement == "attach":  # the user's tasks' peers: asked to die, their task restarts them
                candidates = await self._killable_attached()
                if candidates:
                    await self._kill_attached(*self.rng.choice(candidates))
                continue
            candidates = await self._killable()
            if candidates:
                self._kill_peer(self.rng.choice(candidates))

    async def _killable_attached(self) -> list[tuple[int, str, str]]:
        """attach: (stage, uid, DHT peer id) of the declared peers of stages where at least two of them are at the
        stage's latest step (the launcher has no process of theirs to look at: their records say who is alive)."""
        found = []
        for stage in range(self.plan.stages):
            records = await progress_records(self.node, self.run_id, stage)
            declared = await stage_records(self.node, self.run_id, stage)
            live = set(declared) - self.retired
            steps = {stage: {u: r.step for u, r in records.items()}}
            found.extend((stage, uid, declared[uid][0]) for uid in kill_candidates(steps, live))
        return found

    async def _kill_attached(self, stage: int, uid: str, peer: str) -> None:
        """attach: a peer the launcher did not start dies by its ``die`` RPC (it SIGKILLs its own process group, as
        a preempted host would lose it); its ``swarm-peer`` task starts it again as a new incarnation, which
        downloads the stage's state. Counted as a rejoin once the task's new incarnation has declared itself."""
        self.retired.add(uid)
        stub = self._stage_stub(stage, peer)
        with contextlib.suppress(Exception):  # it may die before its reply is out
            await asyncio.wait_for(unpack(await stub.rpc_die(request({}, {}))), timeout=self.plan.sync_timeout_s)
        self.stats["peers_killed"] += 1
        self.stats["killed"].append({"uid": uid, "stage": stage, "t_s": round(self.elapsed(), 2)})
        self._spawn(self._count_rejoin(stage, uid))

    async def _count_rejoin(self, stage: int, uid: str) -> None:
        """attach: wait for the killed peer's task (its rank, ``rank_of_uid``) to declare a new incarnation."""
        rank, prefix = rank_of_uid(uid), uid.split(".")[0] + "."
        deadline = time.monotonic() + self.plan.startup_timeout_s
        while rank is not None and time.monotonic() < deadline:
            declared = await stage_records(self.node, self.run_id, stage)
            if any(u.startswith(prefix) and u != uid and u not in self.retired for u in declared):
                self.stats["rejoins"] += 1
                return
            await asyncio.sleep(SUPERVISE_PERIOD_S)

    async def _fault(self, at_s: float, target: str) -> None:
        """``faults``: SIGKILL ``bootstrap``, ``trainer<R>``, ``peer`` (a killable stage peer), ``stage<S>`` (every
        live peer of stage S but one at its latest step, at once) or ``allofstage<S>`` (every live peer of stage S:
        their restarts find no replica and serve from the stage's shard) at ``at_s``; ``gone<N>:stage<S>`` SIGKILLs N
        live peers of stage S (:func:`gone_victims`) and starts no replacement (they are gone for good: the stage stays
        starved unless the peers rebalance); ``join`` / ``join:<speed>`` starts a new peer of that speed
        (:meth:`_join_peer`); any other target goes to the placement (``plan.hosts.fault``) ``at_s``
        after the first finished microbatch (trainer processes take seconds to start: a link cut must fall into the
        training)."""
        gone, join_speed = parse_gone(target), parse_join(target)
        host_fault = (gone is None and join_speed is None and target not in ("bootstrap", "peer")
                      and not target.startswith(("trainer", "stage", "allofstage")))
        while host_fault and self._done_microbatches() < 1:
            await asyncio.sleep(0.1)
        await asyncio.sleep(at_s)
        if target == "bootstrap":
            self.groups.kill(self.bootstrap)
            self.stats["bootstrap_killed"] += 1
        elif target.startswith("trainer"):
            rank = int(target[len("trainer"):])
            if rank not in self.finished and self.trainers[rank].poll() is None:
                self.groups.kill(self.trainers[rank])
                self.stats["killed"].append({"uid": target, "t_s": round(self.elapsed(), 2)})
        elif gone is not None:
            count, stage = gone
            records = await progress_records(self.node, self.run_id, stage)
            live = {u: records[u].step if u in records else -1 for u, p in self.peers.items()
                    if p.stage == stage and p.alive and u not in self.retired}
            for uid in gone_victims(live, count):
                peer = self.peers[uid]
                self.retired.add(uid)   # never replaced: _supervise restarts only peers that are not retired
                self.groups.kill(peer.proc)
                self.stats["peers_killed"] += 1
                self.stats["killed"].append({"uid": uid, "stage": stage, "t_s": round(self.elapsed(), 2),
                                             "replaced": False})
        elif join_speed is not None:
            await self._join_peer(join_speed)
        elif target == "peer":
            candidates = await self._killable()
            if candidates:
                self._kill_peer(self.rng.choice(candidates))
        elif target.startswith("allofstage"):  # every live peer of the stage; each is restarted as usual
            stage = int(target[len("allofstage"):])
            for uid, peer in list(self.peers.items()):
                if peer.stage == stage and peer.alive and uid not in self.retired:
                    self._kill_peer(peer)
        elif target.startswith("stage"):
            stage = int(target[len("stage"):])
            records = await progress_records(self.node, self.run_id, stage)
            latest = max((r.step for r in records.values()), default=0)
            keep = min((u for u, r in records.items() if r.step == latest and u in self.peers
                        and self.peers[u].alive and u not in self.retired), default=None)
            for uid, peer in list(self.peers.items()):
                if peer.stage == stage and peer.alive and uid not in self.retired and uid != keep and keep:
                    self._kill_peer(peer)
        elif hasattr(self.place, "fault"):  # the placement's own faults (a testbed link cut)
            await asyncio.to_thread(self.place.fault, target)
            self.stats.setdefault("host_faults", []).append({"target": target, "t_s": round(self.elapsed(), 2)})
        else:
            raise ValueError(f"unknown fault target {target!r}")

    async def _join_peer(self, speed: float) -> None:
        """A new stage peer of ``speed`` that joins the running swarm as anyone would (``swarm-join``,
        ``peer_process.serve_joined``): through one live entry of the address file (``fault_rules.join_entry``),
        on the stage it picks itself, with the state it downloads itself; the placement names its process
        ``join<N>`` (the N-th join of the run). Its process group is the run's like any other (killed at the end);
        once it has declared itself it is one of the launcher's peers (``peers``: restarted on its stage should it
        die, a possible victim of later kills). ``stats["joins_started"]`` counts the joins begun;
        ``stats["joined"]``: its uid, stage, speed, the entry it joined through, when it started and when it
        declared itself (seconds into training); ``stats["join_failures"]``: a join with no live entry, or whose
        process exited or did not declare itself within the startup timeout."""
        started, number = round(self.elapsed(), 2), self.stats["joins_started"]
        self.stats["joins_started"] += 1   # before any wait: joins whose start-ups overlap get their own numbers
        declared = {}
        for stage in range(self.plan.stages):
            declared |= await stage_records(self.node, self.run_id, stage)
        live_ids = {peer for uid, (peer, _) in declared.items() if uid not in self.retired}
        bootstrap_alive = self.bootstrap is not None and self.bootstrap.poll() is None
        entry = join_entry(read_addr_file(self.addr_file, 1.0), live_ids, bootstrap_alive)
        failure = {"join": number, "speed": speed, "t_s": started}
        if entry is None:
            self.stats.setdefault("join_failures", []).append(failure | {"why": "no live entry in the address file"})
            return
        proc, log = self.groups.spawn(["--peer", entry, "--speed", repr(speed), "--host", self.host,
                                       "--workdir", str(self.workdir), "--wait-s", repr(self.plan.startup_timeout_s)],
                                      f"join{number}", launcher=JOIN_COMMAND)
        deadline, uid = time.monotonic() + self.plan.startup_timeout_s, None
        while time.monotonic() < deadline and proc.poll() is None:
            if uid is None and (found := JOINED_LINE.search(log.read_text(errors="replace"))):
                uid = found.group(1)
            if uid is not None:
                stage = int(uid[1:uid.index("q")])
                if uid in await stage_records(self.node, self.run_id, stage):
                    self.peers[uid] = PeerProcess(uid, stage, speed, proc, log)
                    self.stats["joined"].append({"uid": uid, "stage": stage, "speed": speed, "via": entry,
                                                 "t_s": started, "declared_s": round(self.elapsed(), 2)})
                    return
            await asyncio.sleep(SUPERVISE_PERIOD_S)
        why = (f"exited with code {proc.returncode}" if proc.poll() is not None
               else f"did not declare itself within {self.plan.startup_timeout_s:.0f} s")
        self.stats.setdefault("join_failures", []).append(
            failure | {"uid": uid, "why": why, "log": log.read_text(errors="replace")[-2000:]})
