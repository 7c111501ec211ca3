"""A launcher's run folder (``launcher``, mixed into ``Launcher`` as ``RunFolder``): its lock, its resume record, the
resume of an interrupted run, and the training clock.

With ``state_dir`` (the swarm_pretrain rule's resumable state folder, under ``results/.state``) the run's folder is
that folder, not a temporary one. The stage peers write their stages' shards to its ``shards/`` folder
(``peer_sync``: every ``checkpoint_every_s`` and once more at the end) and the checkpoint is assembled from the final
shards. ``resume.json`` records what the run was started with (model, recipe, stages, trainers, compressions, seed,
microbatches, the microbatch source's spec and a SHA-1 of its first and last microbatch). A launcher that finds it -
the previous one was killed with everything it started - resumes: the stage peers load their stage's newest shard,
and the trainers' leases follow a work order that owes every microbatch not both stepped by every stage's shard
and recorded with a loss, so no microbatch is lost; a stage whose shard is ahead steps those microbatches again
(at least once, counted in ``duplicate_microbatches``). Only shards of the run's own lives (``resume.json``'s
``lives``) are accepted.
A launcher whose settings or data differ from ``resume.json``'s refuses, naming what differs (``ResumeMismatch``).
The folder is kept when the run fails, and also when it succeeds: its caller removes it once the run's outputs are
written (``train.swarm_pretrain``), so that a kill between the two resumes instead of starting from step 0.

A launcher that finds the run's swarm still training in the folder (its launcher was killed, its processes were
not: they train on for ``launcher_grace_s`` without a heartbeat) re-attaches instead (local placement): it takes the
run's id and clock, joins its DHT, beats its heartbeat and adopts its processes (``launcher``); nothing is resumed
and nothing trained again. The same settings and data are required as for a resume.

The training clock (``membership.CLOCK_FILE``) holds the origin of training time and a seconds budget's deadline. Only
training time counts: a resumed run's origin is its start less its earlier lives' training time (``TIME_FILE``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time

from cramswarm.io import read_json, write_json, write_text
from cramswarm.swarm import data
from cramswarm.swarm.membership import ADDR_FILE, CLOCK_FILE, CONFIG_FILE
from cramswarm.swarm.processes import swarm_processes
from cramswarm.swarm.progress import read_clock
from cramswarm.swarm.shards import load_shard, newest_shard
from cramswarm.swarm.work import WorkOrder

RESUME_FILE = "resume.json"  # in a state folder: what the run was started with (a rerun resumes only the same)
LOCK_FILE = "launcher.lock"
TIME_FILE = "launcher.json"  # in a state folder: training seconds so far, first start (wall clock)
STALE_WAIT_S = 45.0       # a resuming launcher waits this long for the killed run's processes to be gone


class ResumeMismatch(ValueError):
    """A state folder holds an interrupted run whose settings or data differ from this one's."""


def differences(old, new, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two JSON-like values, with both values (``key: old -> new``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                found.append(f"{name}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}")
            else:
                found.extend(differences(old[key], new[key], name))
        return found
    return [] if old == new else [f"{prefix or 'value'}: {old!r} -> {new!r}"]


def step_of(line: str) -> int:
    """The step of a log line (-1 for a line cut short)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1


def mb_of(line: str) -> int | None:
    """The microbatch of a trainer's loss record (None for a record cut short)."""
    try:
        row = json.loads(line)
        return int(row["mb"]) if "loss" in row else None
    except (ValueError, KeyError, TypeError):
        return None


class RunFolder:
    """``Launcher``'s run folder: it uses the launcher's ``plan``, ``source``, ``total``, ``workdir``,
    ``state_dir``, ``shard_dir``, ``run_id``, ``stats``, ``start_wall`` and ``elapsed``, and sets ``lock_fd``,
    ``next_uid``, ``wall_before``, ``first_start_wall`` and ``run_ids`` (the run's lives, this one last)."""

    def _lock(self) -> None:
        """Hold ``launcher.lock`` in the state folder until ``run`` returns: two launchers on one folder at once
        would resume the same run twice."""
        self.lock_fd = os.open(self.workdir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.lock_fd)
            raise RuntimeError(f"another launcher is running on the swarm state folder {self.workdir}") from None

    def _fingerprint(self) -> dict:
        """What a resumed run must share with the interrupted one (timeouts, faults, hosts may change)."""
        p = self.plan
        return json.loads(json.dumps({
            "arch": p.arch, "vocab_size": p.vocab_size, "recipe": p.recipe, "stages": p.stages,
            "trainers": p.trainers, "compression": p.compression, "averaging_compression": p.averaging_compression,
            "seed": p.seed, "microbatches": self.total}))

    def _clear(self) -> None:
        """A fresh start in a state folder: remove an earlier run's files (all but the lock)."""
        for path in self.workdir.iterdir():
            if path.name == LOCK_FILE:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _prepare(self) -> int:
        """Check the microbatch source; in a state folder holding an interrupted run, check that this run
        is the same and set it up to re-attach to its live swarm (``reattach``: its run id) or to resume from the
        shards. Returns the tokens per sequence."""
        record_path = self.workdir / RESUME_FILE
        self.reattach = self._live_swarm() if self.state_dir is not None else None
        if self.state_dir is not None and self.reattach is None:
            self._wait_for_stale_processes()
        previous = read_json(record_path) if self.state_dir is not None and record_path.exists() else None
        fingerprint = self._fingerprint()
        if previous is not None:
            diff = differences(previous["fingerprint"], fingerprint)
            if diff:
                raise ResumeMismatch(f"cannot resume the interrupted swarm run in {self.workdir}: its settings differ "
                                     f"from this run's ({'; '.join(diff)}); rerun with the interrupted run's "
                                     f"settings, or remove {self.workdir} to start from step 0")
        elif self.state_dir is not None:
            self._clear()
        seq_len, digest, spec = int(self.source[0][0].shape[1]), data.fingerprint(self.source, self.total), \
            self.source.spec()
        if previous is not None:
            diff = differences(previous.get("data"), spec, "data")
            if diff or previous["data_sha1"] != digest:
                raise ResumeMismatch(f"cannot resume the interrupted swarm run in {self.workdir}: its training "
                                     f"microbatches differ from this run's ({'; '.join(diff) or 'same source'}; "
                                     f"SHA-1 {previous['data_sha1']} -> {digest}: other blocks or masking); remove "
                                     f"{self.workdir} to start from step 0")
            if self.reattach is not None:  # the same life goes on under this launcher
                self.run_id, self.run_ids = self.reattach, list(previous.get("lives", [self.reattach]))
                return seq_len
            self._resume(previous.get("lives", []))
            # the run's lives: its shards and the peers of its earlier lives carry one of these ids
            self.run_ids = [*previous.get("lives", []), self.run_id]
            write_json(record_path, {**previous, "lives": self.run_ids})
        elif self.state_dir is not None:
            write_json(record_path, {"fingerprint": fingerprint, "data": spec, "data_sha1": digest,
                                     "seq_len": seq_len, "lives": self.run_ids})
        return seq_len

    def _resume(self, previous_lives: list[str]) -> None:
        """Set up the folder of an interrupted run: its trainers' leases follow a new work order
        (``work.WorkOrder.after``) that owes every microbatch not both stepped by every stage's newest shard and
        recorded with a loss, the gaps first; the last stage's log keeps the shard's steps. A shard that none of
        the run's earlier lives (``previous_lives``) wrote is refused (``shards.ForeignShard``)."""
        (self.workdir / ADDR_FILE).unlink(missing_ok=True)  # the dead swarm's addresses
        (self.workdir / CLOCK_FILE).unlink(missing_ok=True)  # its clock: this life writes its own
        for tmp in [*self.workdir.glob(".*.tmp"), *self.shard_dir.glob(".*")]:  # writes cut short
            tmp.unlink(missing_ok=True)
        shards = [newest_shard(self.shard_dir, s) for s in range(self.plan.stages)]
        states = [load_shard(found[1], tuple(previous_lives)) if found else None for found in shards]
        per_stage = [set(state.get("stepped_mbs", [])) if state else set() for state in states]
        recorded: set[int] = set()
        for losses in self.workdir.glob("trainer*.losses.jsonl"):  # whole records only (a write cut short by a kill
            lines = [line for line in losses.read_text().splitlines() if mb_of(line) is not None]  # is dropped)
            write_text(losses, "".join(f"{line}\n" for line in lines))
            recorded |= {mb_of(line) for line in lines}
        finished = set.intersection(*per_stage) & recorded
        self.order = WorkOrder.after(self.total, finished)
        last_step = shards[-1][0] if shards[-1] else 0
        for path in self.workdir.glob(f"log-s{self.plan.stages - 1}[pr]*.jsonl"):  # steps the shard holds
            kept = [line for line in path.read_text().splitlines() if step_of(line) <= last_step]
            write_text(path, "".join(f"{line}\n" for line in kept))
        self.next_uid = self._last_uid()  # fresh uids: the dead peers' logs and counters stay
        with contextlib.suppress(Exception):  # a run killed before its training started has none
            times = read_json(self.workdir / TIME_FILE)
            self.wall_before, self.first_start_wall = float(times["wall_s"]), float(times["start_wall"])
        self.stats["resumed"] = {"wall_s_before": round(self.wall_before, 3),
                                 "shard_steps": [found[0] if found else 0 for found in shards],
                                 "finished_before": len(finished), "owed_first": len(self.order.holes),
                                 "from_microbatch": self.order.start,
                                 # per stage: microbatches its shard stepped that the order trains again
                                 "retrained": [len(stepped - finished) for stepped in per_stage]}
        print(f"resuming the swarm run in {self.workdir}: stage shards at steps {self.stats['resumed']['shard_steps']}"
              f", {len(finished)} microbatches finished; the trainers take {len(self.order.holes)} owed ones, then "
              f"go on from microbatch {self.order.start}", flush=True)

    def _done_microbatches(self) -> int:
        """Microbatches the trainers have done (the progress files of every trainer in the folder, added ones too)."""
        done = 0
        for path in self.workdir.glob("trainer*.json"):
            with contextlib.suppress(Exception):
                done += read_json(path)["done"]
        return done

    def _trainer_finished(self, rank: int) -> bool:
        """Whether trainer ``rank``'s progress file says it ended with nothing left to train (this run's lives)."""
        with contextlib.suppress(Exception):
            progress = read_json(self.workdir / f"trainer{rank}.json")
            return progress.get("run_id") in self.run_ids and bool(progress.get("finished"))
        return False

    def _last_uid(self) -> int:
        """The highest peer number ``n`` of the ``s<stage>p<n>`` logs in the folder (0 for none)."""
        used = [int(p.stem.split("p")[-1]) for p in self.workdir.glob("s*p*.log") if p.stem.split("p")[-1].isdigit()]
        return max(used, default=0)

    def _markers(self) -> set[str]:
        """What the command line of every process of this folder's swarm names: its config or its address file."""
        return {str(self.workdir / CONFIG_FILE), str(self.workdir / ADDR_FILE)}

    def _live_swarm(self) -> str | None:
        """The run id of the swarm still training in this folder: the one its config names, once that run's
        training clock was written, while a stage peer or trainer of it lives on this host (local placement only:
        other placements' processes are elsewhere). None otherwise: nothing alive, or a swarm still starting (its
        processes are waited for, then the run resumes)."""
        if self.plan.placement != "local" or not (self.workdir / RESUME_FILE).exists():
            return None
        with contextlib.suppress(Exception):
            run_id = read_json(self.workdir / CONFIG_FILE)["run_id"]
            live = swarm_processes(self._markers())
            if read_clock(self.workdir, run_id)["origin_wall"] is not None and (live["stage"] or live["trainer"]):
                return run_id
        return None

    def _wait_for_stale_processes(self) -> None:
        """The killed run's peers and trainers exit by themselves (their parent is gone, or its heartbeat): wait
        for them (every live process, whatever its role, whose command line names this folder's config or DHT address
        file), so that none writes a shard or a progress file under the resumed run."""
        deadline = time.monotonic() + STALE_WAIT_S
        while stale := [pid for role in swarm_processes(self._markers()).values() for pid, _ in role]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {stale} of the interrupted swarm run in {self.workdir} are still "
                                   f"running after {STALE_WAIT_S:.0f} s; end them before resuming")
            time.sleep(0.5)

    def _write_clock(self) -> None:
        """The training clock the trainers and peers read (``membership.CLOCK_FILE``): training time 0 is this
        life's start less the earlier lives' training time; a seconds budget ends ``budget`` seconds after it."""
        origin = self.start_wall - self.wall_before
        budget = self.plan.recipe["budget"]
        deadline = origin + float(budget["value"]) if budget["unit"] == "seconds" else None
        write_json(self.workdir / CLOCK_FILE, {"run_id": self.run_id, "origin_wall": origin,
                                               "deadline_wall": deadline})
        self.stats["deadline_s"] = round(deadline - origin, 3) if deadline is not None else None

    def _record_time(self) -> None:
        """In a state folder: the training time so far (all lives) and the first life's start, for a resume."""
        if self.state_dir is not None:
            write_json(self.workdir / TIME_FILE, {"wall_s": self.wall_before + self.elapsed(),
                                                  "start_wall": self.first_start_wall})
