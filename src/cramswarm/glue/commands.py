"""Commands of GLUE fine-tuning: finetune."""

from __future__ import annotations

import json

from cramswarm.cli import arg, command, json_arg, set_threads
from cramswarm.config import schema_default

PROTOCOL_HELP = "JSON of one fine-tuning protocol: a glue.protocols entry plus glue.max_length_tokens and glue.device"


@command(
    "finetune",
    "fine-tune a checkpoint on one GLUE task, once per seed (several seeds share one process); write validation "
    "scores (JSON, one file per seed)",
    arg("--checkpoint", required=True),
    arg("--task", required=True),
    arg("--data", required=True),
    arg("--seed", type=int, nargs="+", required=True, help="fine-tuning seeds, each written to the matching --out"),
    arg("--protocol", type=json_arg, required=True, help=PROTOCOL_HELP),
    arg("--model", required=True, help="model name recorded in the result"),
    arg("--vocab", type=int, required=True, help="vocab size recorded in the result"),
    arg("--precision", default=schema_default("pretrain.precision"), choices=("auto", "bf16", "fp16", "fp32")),
    arg("--out", nargs="+", required=True, help="result JSON per seed, in --seed order"),
    arg("--cache-dir", help="keep each finished seed here and reuse it when the inputs are unchanged"),
    arg("--threads", type=int, default=1),
    arg("--quiet", action="store_true", help="no progress bar"),
)
def finetune(args) -> int:
    from cramswarm.glue.finetune import finetune_seeds

    if len(args.seed) != len(args.out):
        raise SystemExit(f"cramswarm finetune: {len(args.seed)} --seed values but {len(args.out)} --out paths")
    set_threads(args.threads)
    labels = {"model": args.model, "vocab": args.vocab}
    results = finetune_seeds(
        args.checkpoint, args.task, args.data, args.seed, args.protocol, args.out, labels, args.precision,
        not args.quiet, args.cache_dir,
    )  # fmt: skip
    for result in results:
        print(result["seed"], json.dumps(result["scores"], sort_keys=True))
    return 0
