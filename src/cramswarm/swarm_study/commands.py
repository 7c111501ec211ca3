"""The SWARM experiments' command: swarm-study."""

from __future__ import annotations

from cramswarm.cli import arg, command, json_arg

# swarm_study config section -> its keyword renames for the cramswarm.swarm_study.study function of the same name
EXPERIMENTS = {
    "square_cube": {"batch_sequences": "batch", "seq_len_tokens": "seq_len"},
    "wiring_throughput": {},
    "failures_timeline": {},
    "rebalancing_recovery": {},
    "compression_loss": {"micro_batch_sequences": "micro_batch"},
    "sim_scale": {},
}


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
    from cramswarm.swarm_study import study

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
