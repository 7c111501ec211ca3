"""The end of a launcher's run (``launcher``, mixed into ``Launcher`` as ``RunResult``): the last, partial global
batch (``_finish_steps``), the stages' states from their live replicas and final shards (``_collect_states``,
``_final_shards``), and the result assembled from the run folder (``_result``: the last stage's step log, the
trainers' losses and counters, the peers' counters, moves and step stalls).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Iterator

import torch
from hivemind.utils import get_dht_time

from cramswarm.io import read_json
from cramswarm.swarm import averaging, data
from cramswarm.swarm.emulation_training import TrainResult
from cramswarm.swarm.membership import RECORD_TTL_S, flush_key, stage_records
from cramswarm.swarm.peer_sync import SYNC_LOG
from cramswarm.swarm.processes import SUPERVISE_PERIOD_S
from cramswarm.swarm.progress import overshoot, progress_records, stage_stalls
from cramswarm.swarm.routing import NoPeersError
from cramswarm.swarm.run_state import mb_of, step_of
from cramswarm.swarm.shards import load_shard, newest_shard
from cramswarm.swarm.wire import BufferReader, request, unpack

IDLE_READS = 3            # a stage is idle once this many reads in a row show no held samples and one step
COLLECT_ATTEMPTS = 3      # the end of a run asks a stage for its state this many times (twice the wait each time)
PEER_MEMORY_KEYS = ("uid", "stage", "stage_parameter_count", "parameter_bytes", "optimizer_bytes", "peak_rss_bytes",
                    "rss_bytes", "runtime_rss_bytes", "activation_bytes")


def _summed(counts) -> dict[str, int]:
    """Per key, the sum of the counts of several dicts (the peers' counters)."""
    total: Counter[str] = Counter()
    for one in counts:
        total.update(one)
    return dict(sorted(total.items()))


def latest_stage_state(counters: list[dict], stages: int) -> list[dict]:
    """Per stage, the counters of its most advanced replica (the highest step, then stepped samples; ``{}`` for a
    stage without any): the stage's state every replica holds, read from one replica so that its stepped samples and
    duplicates agree. A folder also holds the counters of an earlier life's peers, whose steps past the shard a
    resume started from were stepped again."""
    return [max((c for c in counters if c["stage"] == s), key=lambda c: (c.get("step", 0), c.get("stepped_samples", 0)),
                default={}) for s in range(stages)]


class RunResult:
    """``Launcher``'s end of run: it uses the launcher's ``plan``, ``total``, ``node``, ``run_id``, ``workdir``,
    ``shard_dir``, ``stage_params``, ``stats``, ``peers``, ``groups``, ``start_wall``, ``first_start_wall``,
    ``moves_base``, ``_stage_stub``, ``_move_events`` and ``_done_microbatches``."""

    async def _finish_steps(self) -> None:
        """Ask the peers for the last, partial global batch and wait until every stage is idle."""
        await self.node.store(flush_key(self.run_id), True, get_dht_time() + 3600)
        bound = max(self.plan.retry.give_up_after_s, 3 * max(
            averaging.averaging_timeout_s(n, max(self.plan.peers_per_stage), self.plan.averaging_compression,
                                          self.plan.link_mbit_s, 2 * self.plan.sync_timeout_s)
            for n in self.stage_params))
        deadline, idle = time.monotonic() + bound, 0
        while idle < IDLE_READS:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stages did not finish their last steps within {bound:.0f} s")
            quiet = True
            for stage in range(self.plan.stages):
                records = await progress_records(self.node, self.run_id, stage)
                steps = {r.step for r in records.values()}
                quiet &= bool(records) and len(steps) == 1 and not any(r.samples or r.ready
                                                                        for r in records.values())
            idle = idle + 1 if quiet else 0
            await asyncio.sleep(SUPERVISE_PERIOD_S)

    async def _final_shards(self, replica_steps: dict[int, dict[str, int]]) -> tuple[list[dict | None], list[int]]:
        """The stages' final shards (module state dicts; None for a stage that never stepped), once each stage's
        newest shard is at the step its live replicas reached."""
        bound = max(self.plan.retry.give_up_after_s, 3 * max(
            averaging.state_timeout_s(n, self.plan.link_mbit_s, 2 * self.plan.sync_timeout_s)
            for n in self.stage_params))
        deadline = time.monotonic() + bound
        while True:
            found = [newest_shard(self.shard_dir, s) for s in range(self.plan.stages)]
            lacking = [s for s in range(self.plan.stages) if max(replica_steps[s].values()) > 0 and
                       (found[s] is None or found[s][0] < max(replica_steps[s].values()))]
            if not lacking:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"stages {lacking} wrote no shard of their last step within {bound:.0f} s "
                                   f"(newest: {[f[1].name if f else None for f in found]}; logs in {self.workdir})")
            await asyncio.sleep(SUPERVISE_PERIOD_S)
        states = [load_shard(f[1], tuple(self.run_ids)) if f else None for f in found]
        self.stats["stepped_microbatches"] = [len(s.get("stepped_mbs", [])) if s else 0 for s in states]
        return [s["module"] if s else None for s in states], [f[0] if f else 0 for f in found]

    async def _declared(self, stage: int) -> dict[str, tuple[str, float]]:
        """The stage's declared replicas; an empty read is read again for up to two record lifetimes (a replica whose
        re-declaration was slow on a loaded host lapses for a moment)."""
        deadline = time.monotonic() + 2 * RECORD_TTL_S
        while not (records := await stage_records(self.node, self.run_id, stage)) and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
        if not records:
            alive = {uid: peer.alive for uid, peer in self.peers.items() if peer.stage == stage}
            print(f"[launcher] stage {stage}: no replica declared for {2 * RECORD_TTL_S:.0f} s (its peer processes, "
                  f"alive or not: {alive})", flush=True)
        return records

    async def _stage_replicas(self, stage: int, floor_s: float) -> list[tuple[str, int, dict]]:
        """(uid, step, module state) of every live replica of ``stage`` that sends its state within the timeout."""
        replicas = []
        for uid, (peer, _) in (await self._declared(stage)).items():
            stub = self._stage_stub(stage, peer)
            try:
                tensors, meta = await asyncio.wait_for(
                    unpack(await stub.rpc_state(request({}, {}))),
                    timeout=averaging.state_timeout_s(self.stage_params[stage], self.plan.link_mbit_s, floor_s))
            except Exception as e:
                print(f"[launcher] {uid} sent no state of stage {stage} within {floor_s:.0f} s + transfer: {e!r}",
                      flush=True)
                continue
            blob = torch.load(BufferReader(tensors["blob"].numpy()), weights_only=True, map_location="cpu")
            replicas.append((uid, meta["step"], blob["module"]))
        return replicas

    async def _collect_states(self) -> tuple[list[dict], dict[int, dict[str, int]], list[float]]:
        """Every stage's live replicas at the end. A stage none of whose replicas answered is asked again, up to
        ``COLLECT_ATTEMPTS`` times with twice the wait each time (a loaded host's only replica may miss the first
        wait; a stage with no declared replica is read again for a while first, ``_declared``); each failure is
        printed."""
        states, steps, spread = [], {}, []
        for stage in range(self.plan.stages):
            floor_s = 2 * self.plan.sync_timeout_s
            for _ in range(COLLECT_ATTEMPTS):
                replicas = await self._stage_replicas(stage, floor_s)
                if replicas:
                    break
                floor_s *= 2
            if not replicas:
                raise NoPeersError(stage)
            replicas.sort()
            reference = replicas[0][2]
            spread.append(max((float((reference[k].float() - state[k].float()).abs().max()) for _, _, state in
                               replicas[1:] for k in reference if reference[k].numel()), default=0.0))
            states.append(reference)
            steps[stage] = {uid: step for uid, step, _ in replicas}
        return states, steps, spread

    # -- the result --------------------------------------------------------------------------------------------
    def _rows(self, pattern: str) -> Iterator[dict]:
        """The JSON lines of the run folder's files matching ``pattern``, file by file in name order (a line cut short
        by a kill is skipped)."""
        for path in sorted(self.workdir.glob(pattern)):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    yield json.loads(line)

    def _log(self) -> list[dict]:
        rows = {}
        for row in self._rows(f"log-s{self.plan.stages - 1}[pr]*.jsonl"):
            rows.setdefault(row["step"], row)
        return [{k: v for k, v in row.items() if k not in ("time", "group")}
                | {"elapsed_s": round(row["time"] - self.first_start_wall, 3)} for _, row in sorted(rows.items())]

    def _first_logged_step(self) -> int | None:
        """The first step the last stage's peers of this launcher logged (1 unless it resumed from shards)."""
        steps = []
        for uid, peer in self.peers.items():
            path = self.workdir / f"log-{uid}.jsonl"
            if peer.stage == self.plan.stages - 1 and path.exists():
                steps.extend(step_of(line) for line in path.read_text().splitlines())
        return min((s for s in steps if s >= 0), default=None)

    def _loss_rows(self) -> Iterator[dict]:
        """The trainers' loss records (one per microbatch done): the launcher's trainers and added ones."""
        return self._rows("trainer*.losses.jsonl")

    def _done_times(self) -> list[float]:
        """Seconds into training at which each microbatch was done (a resumed one: its last time), sorted."""
        return sorted({row["mb"]: round(row["time"] - self.start_wall, 3) for row in self._loss_rows()}.values())

    def _moves(self) -> list[dict]:
        """Each move the peers decided: when (seconds into training), who, from where to where, and once it
        arrived, when and under which uid, how long its drain took and the gradient samples it dropped."""
        moves, open_moves = [], {}
        for event in self._move_events()[self.moves_base:]:
            uid = event.move.uid
            if event.event == "decided":
                open_moves[uid] = move = {
                    "t_s": round(event.time - self.start_wall, 3), "uid": uid, "from_stage": event.move.from_stage,
                    "to_stage": event.move.to_stage, "period": event.period}
                moves.append(move)
            elif uid in open_moves:
                open_moves.pop(uid).update(
                    arrived_s=round(event.time - self.start_wall, 3), new_uid=event.new_uid, drain_s=event.drain_s,
                    handed_over_samples=event.handed_over_samples,
                    lost_gradient_samples=event.lost_gradient_samples)
        return moves

    def _trainer_stats(self) -> dict:
        """The trainers' call and lease counters (retries, timeouts, errors; leases taken, adopted, yielded), summed
        over every trainer of the folder, and the microbatches each one did; a restarted trainer and a resumed run
        count on from the earlier lives (stepped samples restored from a shard include their re-sent calls)."""
        counted = ("retries", "timeouts", "errors", "leases", "adopted_leases", "yielded_leases")
        total: dict = dict.fromkeys(counted, 0)
        for path in sorted(self.workdir.glob("trainer*.json")):
            with contextlib.suppress(Exception):
                stats = read_json(path)["stats"]
                for key in counted:
                    total[key] += stats.get(key, 0)
                if "last_error" in stats:
                    total["last_error"] = stats["last_error"]
        # each trainer's loss records (a record cut short by a kill is no microbatch done)
        total["trainer_microbatches"] = {path.name[len("trainer"):-len(".losses.jsonl")]: sum(
            mb_of(line) is not None for line in path.read_text().splitlines())
            for path in sorted(self.workdir.glob("trainer*.losses.jsonl"))}
        return total

    def _peer_counters(self) -> list[dict]:
        found = []
        for path in sorted(self.workdir.glob("peer-*.json")):
            with contextlib.suppress(Exception):
                found.append(read_json(path))
        return found

    def _step_stalls(self, rows: list[dict]) -> dict[str, list[dict]]:
        """``progress.stage_stalls`` of the peers' step lines, times rounded to ms and ``end`` as seconds from the
        first start (as the log's ``elapsed_s``); keyed by the stage as a string (JSON keys)."""
        stalls = stage_stalls(rows)
        base = self.first_start_wall or 0.0
        return {str(stage): [{k: (round(v - base if k == "end" else v, 3) if isinstance(v, float) else v)
                              for k, v in entry.items()} for entry in entries] for stage, entries in stalls.items()}

    def _result(self, stage_states, replica_steps, spread, wall_s) -> TrainResult:
        losses = {row["mb"]: row["loss"] for row in self._loss_rows()}
        done = len(losses)   # microbatches with a loss record: trained to the end (every life, every trainer)
        counters, rows = self._peer_counters(), list(self._rows(SYNC_LOG.format(uid="*")))
        micro = self.plan.recipe["micro_batch_sequences"]
        latest = latest_stage_state(counters, self.plan.stages)
        stepped = [c.get("stepped_samples", 0) for c in latest]

        def per_stage(key: str) -> list[int]:
            return [sum(c.get(key, 0) for c in counters if c["stage"] == s) for s in range(self.plan.stages)]

        sent, values = per_stage("averaging_bytes_sent"), per_stage("averaging_values_sent")
        param_steps = per_stage("averaging_param_steps")

        log = self._log()
        moves = self._moves()
        self.stats.update(self._trainer_stats())
        self.stats["first_logged_step"] = self._first_logged_step()
        self.stats["peer_devices"] = {c["uid"]: c.get("device", "cpu") for c in counters}  # where each peer computed
        # peers that found no live replica of their stage and served from its shard (the stage's last ones died)
        self.stats["served_from_shard_alone"] = {c["uid"]: c["served_from_shard_alone"] for c in counters
                                                 if c.get("served_from_shard_alone") is not None}
        # a seconds budget: the trainers took microbatches until the deadline, and each one they took counts
        requested = self.total if data.bounded(self.total) else done
        self.stats.update(
            transport="hivemind", placement=self.plan.placement, roles="launcher", microbatches_done=done,
            microbatches_requested=requested, lost_microbatches=requested - done,
            microbatches_with_loss=len(losses), trainer_losses=[losses[i] for i in sorted(losses)],
            steps=len(log), stage_steps=[max(steps.values()) for steps in replica_steps.values()],
            # at least once (peer_sync): a stage's stepped samples may pass the microbatches' by the duplicates;
            # lost are the microbatches of the run that the stage's final shard does not list as stepped
            stepped_samples=stepped, duplicate_microbatches=[c.get("duplicate_microbatches", 0) for c in latest],
            lost_gradient_samples=[(requested - n) * micro for n in self.stats.get("stepped_microbatches",
                                                                                   [requested] * len(stepped))],
            resent_samples=per_stage("resent_samples"),
            step_overshoot={str(stage): entry for stage, entry in overshoot(rows).items()},
            wall_s=round(wall_s, 3), throughput_mb_s=round(done / wall_s, 4) if wall_s > 0 else 0.0,
            per_stage_peers=[len(steps) for steps in replica_steps.values()], replica_steps=replica_steps,
            replicas_equal=not any(spread), replica_max_abs_diff=spread, process_groups=list(self.groups.pgids),
            resyncs=sum(c["resyncs"] for c in counters), digest_mismatches=sum(c["digest_mismatches"]
                                                                              for c in counters),
            joining_wait_s=round(sum(c.get("joining_wait_s", 0.0) for c in counters), 3),
            stage_parameters=self.stage_params, averaging_compression=self.plan.averaging_compression,
            peer_memory=[{key: c.get(key) for key in PEER_MEMORY_KEYS} for c in counters],
            averaging_bytes_per_param=[round(b / n, 4) if n else None for b, n in zip(sent, param_steps)],
            averaging_bytes_per_value=[round(b / n, 4) if n else None for b, n in zip(sent, values)],
            moves=moves, moves_completed=sum("arrived_s" in m for m in moves), microbatch_done_s=self._done_times(),
            incomplete_load_views=sum(c.get("incomplete_views", 0) for c in counters),
            incomplete_view_missing=_summed(c.get("incomplete_view_missing", {}) for c in counters),
            late_load_views=sum(c.get("late_views", 0) for c in counters),
            malformed_rebalance_records=sum(c.get("malformed_rebalance_records", 0) for c in counters),
            peer_loads={c["uid"]: c["load"] for c in counters if "load" in c},
            peer_backward_samples={c["uid"]: c.get("backward_samples", 0) for c in counters},
            step_stalls=self._step_stalls(rows),
        )
        return TrainResult(stage_states=stage_states, log=log, stats=self.stats)
