"""Commands of SWARM parallelism: swarm-pretrain, swarm-peer, swarm-join, swarm-train."""

from __future__ import annotations

import json

from cramswarm.cli import arg, command, json_arg, set_threads


@command(
    "swarm-pretrain",
    "pretrain a model with SWARM parallelism (stages x replicas); writes a crammed-layout checkpoint",
    arg("--arch", type=json_arg, required=True, help="JSON of a models.<name>.arch section"),
    arg("--recipe", type=json_arg, required=True, help="JSON of the model's pretrain recipe"),
    arg("--swarm", type=json_arg, required=True, help="JSON of what the swarm computes: the swarm section less impl"),
    arg("--impl", type=json_arg, default={}, help="JSON of pretrain.impl (the peers' device, the log's granularity)"),
    arg("--swarm-impl", type=json_arg, default={}, help="JSON of swarm.impl: how the swarm runs (placement, timeouts)"),
    arg("--blocks", required=True),
    arg("--tokenizer", required=True),
    arg("--out-dir", required=True),
    arg("--run", help="run name recorded in the summary"),
    arg("--vocab-size", type=int, help="vocab size this run expects; the tokenizer must match"),
    arg(
        "--rendezvous",
        help="swarm.impl.placement attach: folder (shared filesystem) where the peers find config.json and the DHT "
        "address file; under the launcher (placements local and srun): its launcher/ subfolder holds the resumable "
        "state (stage shards), so a rerun after a kill resumes",
    ),
    arg("--threads", type=int, default=1),
    arg("--quiet", action="store_true", help="no progress bar"),
)
def swarm_pretrain(args) -> int:
    from cramswarm.impl import PretrainImpl
    from cramswarm.swarm.train import swarm_pretrain as run

    set_threads(args.threads)
    summary = run(
        args.recipe, args.arch, args.swarm, args.blocks, args.tokenizer, args.out_dir, progress=not args.quiet,
        run=args.run, expected_vocab=args.vocab_size, rendezvous=args.rendezvous, impl=PretrainImpl.parse(args.impl),
        swarm_impl=args.swarm_impl,
    )  # fmt: skip
    print(json.dumps({k: summary[k] for k in ("steps", "tokens", "final_loss", "eval_loss") if k in summary}))
    return 0


@command(
    "swarm-peer",
    "serve as one peer of a running swarm-pretrain (swarm.impl.placement attach)",
    arg(
        "--rendezvous",
        required=True,
        help="the launcher's rendezvous folder (swarm-pretrain --rendezvous), on a filesystem this host shares",
    ),
    arg(
        "--rank",
        type=int,
        help="this peer's rank, 0 .. stages x peers_per_stage - 1 (default: SLURM_PROCID); it decides stage and speed",
    ),
    arg("--max-restarts", type=int, default=100, help="restarts of a dying peer (count)"),
    arg("--wait-s", type=float, default=600.0, help="seconds to wait for the launcher's rendezvous files and swarm"),
)
def swarm_peer(args) -> int:
    from cramswarm.swarm.peer_process import run_task

    return run_task(args.rendezvous, args.rank, args.max_restarts, args.wait_s)


@command(
    "swarm-join",
    "join a running swarm-pretrain through any live process's address and serve the stage it needs most",
    arg("--peer", required=True, help="multiaddr of any live process of the swarm (a line of its dht_addrs.txt)"),
    arg("--speed", type=float, default=1.0, help="compute speed factor of this peer (1.0: full speed)"),
    arg("--host", default="127.0.0.1", help="IPv4 address this peer listens on (0.0.0.0: every interface)"),
    arg("--workdir", help="folder for this peer's logs and counters when this host lacks the run's folder"),
    arg("--wait-s", type=float, default=60.0, help="seconds to reach the peer and find the swarm's description"),
)
def swarm_join(args) -> int:
    from cramswarm.swarm.peer_process import run_join

    return run_join(args.peer, args.speed, args.host, args.workdir, args.wait_s)


@command(
    "swarm-train",
    "add a trainer to a running swarm-pretrain through any live process's address; it leaves on SIGTERM or Ctrl-C",
    arg("--peer", required=True, help="multiaddr of any live process of the swarm (a line of its dht_addrs.txt)"),
    arg("--name", help="this trainer's name in the claim records (default: j<host>-<pid>); a restart under the "
                       "same name goes on with its lease"),
    arg("--host", default="127.0.0.1", help="IPv4 address this trainer listens on (0.0.0.0: every interface)"),
    arg("--workdir", help="folder for this trainer's losses and progress when this host lacks the run's folder"),
    arg("--wait-s", type=float, default=60.0, help="seconds to reach the peer and find the swarm's description"),
)
def swarm_train(args) -> int:
    from cramswarm.swarm.membership import leave_now
    from cramswarm.swarm.trainer import run, train_joined

    code = run(train_joined(args.peer, args.name, args.host, args.workdir, args.wait_s), args.name or "joined")
    leave_now(code)
