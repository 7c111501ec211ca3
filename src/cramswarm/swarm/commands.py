"""Commands of SWARM parallelism: swarm-pretrain, swarm-peer, swarm-study."""

from __future__ import annotations

import json

from cramswarm.cli import arg, command, json_arg, set_threads

# swarm_study config section -> its keyword renames for the cramswarm.swarm.study function of the same name
EXPERIMENTS = {
    "square_cube": {"batch_sequences": "batch", "seq_len_tokens": "seq_len"},
    "wiring_throughput": {},
    "failures_timeline": {},
    "rebalancing_recovery": {},
    "compression_loss": {"micro_batch_sequences": "micro_batch"},
    "sim_scale": {},
}

@command(
    "swarm-pretrain",
    "pretrain a model with SWARM parallelism (stages x replicas); writes a crammed-layout checkpoint",
    arg("--arch", type=json_arg, required=True, help="JSON of a models.<name>.arch section"),
    arg("--recipe", type=json_arg, required=True, help="JSON of the model's pretrain recipe"),
    arg("--swarm", type=json_arg, required=True, help="JSON of the swarm section"),
    arg("--blocks", required=True),
    arg("--tokenizer", required=True),
    arg("--out-dir", required=True),
    arg("--run", help="run name recorded in the summary"),
    arg("--vocab-size", type=int, help="vocab size this run expects; the tokenizer must match"),
    arg(
        "--rendezvous",
        help="swarm.placement attach: folder (shared filesystem) where the peers find config.json and the DHT "
        "address file; under the launcher (placements local and srun): its launcher/ subfolder holds the resumable "
        "state (stage shards), so a rerun after a kill resumes",
    ),
    arg("--threads", type=int, default=1),
    arg("--quiet", action="store_true", help="no progress bar"),
)
def swarm_pretrain(args) -> int:
    from cramswarm.swarm.train import swarm_pretrain as run

    set_threads(args.threads)
    summary = run(
        args.recipe, args.arch, args.swarm, args.blocks, args.tokenizer, args.out_dir, progress=not args.quiet,
        run=args.run, expected_vocab=args.vocab_size, rendezvous=args.rendezvous,
    )  # fmt: skip
    print(json.dumps({k: summary[k] for k in ("steps", "tokens", "final_loss", "eval_loss") if k in summary}))
    return 0


@command(
    "swarm-peer",
    "serve as one peer of a running swarm-pretrain (swarm.placement attach)",
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
    from cramswarm.swarm.hivemind_peer import run_task

    return run_task(args.rendezvous, args.rank, args.max_restarts, args.wait_s)


@command(
    "swarm-study",
    "one SWARM experiment (a swarm_study config section) -> one CSV",
    arg("--experiment", required=True, choices=tuple(EXPERIMENTS), help="the experiment (= its CSV's name)"),
    arg("--settings", type=json_arg, required=True, help="JSON of the experiment's swarm_study section"),
    arg("--out", required=True, help="CSV written"),
    arg("--blocks", help="compression_loss: packed blocks (.npy) to train on"),
    arg("--tokenizer", help="compression_loss: the blocks' tokenizer (for the vocab size)"),
    arg("--arch", type=json_arg, help="compression_loss: JSON of a models.<name>.arch section"),
)
def swarm_study(args) -> int:
    from cramswarm.swarm import study

    renames = EXPERIMENTS[args.experiment]
    kwargs = {renames.get(key, key): value for key, value in args.settings.items()}
    run = getattr(study, args.experiment)
    if args.experiment == "compression_loss":
        if not (args.blocks and args.tokenizer and args.arch):
            raise ValueError("swarm-study --experiment compression_loss needs --blocks, --tokenizer and --arch")
        from cramswarm.data import tokenizer as tokenization

        vocab_size = tokenization.load(args.tokenizer).get_vocab_size()
        print(run(args.out, args.blocks, arch=args.arch, vocab_size=vocab_size, **kwargs))
    else:
        print(run(args.out, **kwargs))
    return 0
