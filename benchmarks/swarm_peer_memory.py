"""Where a swarm stage peer's memory goes, call by call: one process runs a stage peer's own compute methods
(``StagePeer._backward``, ``replica.take_snapshot``, ``_apply``, ``_state_blob``) on the memory run's model of
``swarm_launcher.py`` (4 stages, hidden 256, 8 layers, vocabulary 32768, microbatches of 8 x 64 tokens of the
counting language), without DHT or network, and prints per phase the RSS before, the peak during it (``VmHWM``,
reset before each phase through ``/proc/self/clear_refs``; Linux only) and the CPU time it took. A global batch of
``--batch`` microbatches is stepped ``--steps`` times.

    python benchmarks/swarm_peer_memory.py --stage 3                       # the last stage
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 python benchmarks/swarm_peer_memory.py --stage 3   # oneDNN's default
    MALLOC_MMAP_THRESHOLD_=4194304 python benchmarks/swarm_peer_memory.py --stage 3
    python benchmarks/swarm_peer_memory.py --stage 3 --malloc-trim     # glibc's malloc_trim(0) after every call

The peer's oneDNN primitive cache is bounded as a launched peer bounds it (``hivemind_peer.bound_kernel_cache``:
``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` from the environment, else ``PEER_KERNEL_CACHE``).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from cramswarm.swarm.stages import rss_bytes  # noqa: E402

MIB = 2**20


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # resets VmHWM to the current RSS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=3, help="which of the 4 stages (3: the last, with the decoder)")
    parser.add_argument("--batch", type=int, default=4, help="microbatches per in-stage step")
    parser.add_argument("--steps", type=int, default=6, help="in-stage steps")
    parser.add_argument("--precision", default="bf16", help="the peers' autocast precision (bf16 | fp32)")
    parser.add_argument("--malloc-trim", action="store_true",
                        help="call glibc's malloc_trim(0) after every backward call (returns the heap's free pages)")
    args = parser.parse_args(argv)
    import torch
    from swarm_launcher import SEQ, arch, recipe

    from cramswarm.swarm import hivemind_peer as hp
    from cramswarm.swarm import peer_sync  # noqa: F401  (a launched peer imports it too)
    from cramswarm.swarm.compression import encode
    from cramswarm.swarm.data import CountingSource
    from cramswarm.swarm.settings import ProcessConfig, SwarmPlan

    hp.bound_kernel_cache()
    torch.set_num_threads(1)
    stages, micro, width = 4, 8, 256
    swarm = SwarmPlan(arch=arch(width, 2 * stages), vocab_size=32768, peers_per_stage=[1] * stages,
                      recipe=recipe(20, micro, args.batch) | {"precision": args.precision}, compression="none",
                      averaging_compression="none")
    cfg = dataclasses.replace(ProcessConfig.of_plan(swarm, run_id="probe", run_ids=["probe"], seq_len=SEQ,
                                                    workdir=".", shard_dir=".", data={}, microbatches=0, order=None),
                              link_mbit_s=None)
    print(f"RSS {rss_bytes() / MIB:.1f} MiB after the imports; oneDNN cache "
          f"{hp.os.environ[hp.KERNEL_CACHE_ENV]}; MALLOC_MMAP_THRESHOLD_ "
          f"{hp.os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}")
    times: list[float] = []
    trim_cpu: list[float] = []

    def phase(name: str, fn, *fn_args, timed: bool = False):
        before = rss_bytes()
        reset_peak()
        cpu = time.process_time()
        out = fn(*fn_args)
        cpu = time.process_time() - cpu
        peak = rss_bytes("VmHWM")
        if timed:
            times.append(cpu)
        print(f"{name:<20} RSS before {before / MIB:7.1f}  peak {peak / MIB:7.1f} (+{(peak - before) / MIB:6.1f})  "
              f"after {rss_bytes() / MIB:7.1f} MiB  CPU {cpu * 1000:6.1f} ms", flush=True)
        return out

    peer = phase("build + AdamW", lambda: hp.StagePeer(cfg, args.stage, "probe", 1.0, None))
    print(f"stage {args.stage}: {peer.replica.num_params:,} parameters "
          f"({4 * peer.replica.num_params / MIB:.1f} MiB fp32)")
    source = CountingSource(micro, SEQ, 0)

    def request(i: int) -> tuple[dict, dict]:
        ids, labels = source[i]
        g = torch.Generator().manual_seed(i)
        tensors, meta = ({"input_ids": ids}, {}) if args.stage == 0 else ({}, {})
        if args.stage:
            hp.flatten_payload("x", encode(torch.randn(micro, SEQ, width, generator=g), "none"), tensors, meta)
        if args.stage == stages - 1:
            tensors["labels"] = labels
        else:
            hp.flatten_payload("g", encode(torch.randn(micro, SEQ, width, generator=g), "none"), tensors, meta)
        return tensors, meta

    for step in range(args.steps):
        for i in range(step * args.batch, (step + 1) * args.batch):
            phase(f"backward {i}", peer._backward, *request(i), timed=True)
            if args.malloc_trim:
                trim_cpu.append(time.process_time())
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                trim_cpu[-1] = time.process_time() - trim_cpu[-1]
        flat, _ = phase("snapshot", peer.replica.take_snapshot, step)
        peer.averaged = (b"probe", flat)
        del flat
        phase("step (AdamW)", peer._apply, b"probe", 1e-3)
    # a state download (another replica joins): the serving side's messages, then the joining side's (here the same
    # process: the RSS before each phase includes what the earlier one left)
    import asyncio

    from hivemind.utils.asyncio import as_aiter

    def serve() -> list:
        blob, _, _ = peer._state_blob()
        return list(hp.respond({"blob": hp.blob_tensor(blob)}, {}))

    def receive(messages: list) -> dict:
        tensors, _ = asyncio.run(hp.unpack(as_aiter(*messages)))
        messages.clear()   # what the joining side received is dropped once the tensor is whole
        return tensors

    tensors = phase("receive it", receive, phase("serve a download", serve))
    phase("load it", peer._load_state_tensor, tensors.pop("blob"))
    print(f"activations: at most {peer.replica.activation_bytes / MIB:.1f} MiB saved for backward by one call; "
          f"median CPU of a backward call {statistics.median(times) * 1000:.1f} ms; "
          f"final RSS {rss_bytes() / MIB:.1f} MiB")
    if trim_cpu:
        print(f"malloc_trim: median CPU {statistics.median(trim_cpu) * 1000:.1f} ms per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
