"""Commands of GLUE fine-tuning: finetune."""

from __future__ import annotations

import json

from cramswarm.cli import arg, command, json_arg, set_threads
from cramswarm.config import schema_default

PROTOCOL_HELP = "JSON of one fine-tuning protocol: a glue.protocols entry plus glue.max_length_tokens and glue.device"


@command(
    "finetune",
    "fine-tune a checkpoint on GLUE tasks, once per seed (several tasks and seeds share one process); write "
    "validation scores (JSON, one file per task and seed)",
    arg("--checkpoint", required=True),
    arg("--task", nargs="+", required=True, help="GLUE task(s), each with its --data file"),
    arg("--data", nargs="+", required=True, help="the tasks' GLUE data files, in --task order"),
    arg("--seed", type=int, nargs="+", required=True, help="fine-tuning seeds, each written to the matching --out"),
    arg("--protocol", type=json_arg, required=True, help=PROTOCOL_HELP),
    arg("--model", required=True, help="model name recorded in the result"),
    arg("--vocab", type=int, required=True, help="vocab size recorded in the result"),
    arg("--precision", default=schema_default("pretrain.precision"), choices=("auto", "bf16", "fp16", "fp32")),
    arg("--out", nargs="+", required=True, help="result JSON per task and seed: every seed of the first task, then "
        "of the next"),
    arg("--cache-dir", help="keep each finished seed here and reuse it when the inputs are unchanged"),
    arg("--warmup-data", help="the GLUE data of the protocol's warmup_from_task: its train rows set every task's "
        "warmup"),
    arg("--threads", type=int, default=1),
    arg("--quiet", action="store_true", help="no progress bar"),
)
def finetune(args) -> int:
    from cramswarm.data.sources import read_glue
    from cramswarm.glue.finetune import finetune_seeds

    tasks, seeds = args.task, args.seed
    if args.warmup_data:  # recorded in the protocol each result holds
        args.protocol = {**args.protocol, "warmup_reference_rows": len(read_glue(args.warmup_data, "train"))}
    if len(tasks) != len(args.data):
        raise SystemExit(f"cramswarm finetune: {len(tasks)} --task values but {len(args.data)} --data files")
    if len(tasks) * len(seeds) != len(args.out):
        raise SystemExit(
            f"cramswarm finetune: {len(tasks)} --task x {len(seeds)} --seed values need "
            f"{len(tasks) * len(seeds)} --out paths, got {len(args.out)}"
        )
    set_threads(args.threads)
    labels = {"model": args.model, "vocab": args.vocab}
    for i, (task, data) in enumerate(zip(tasks, args.data)):
        outs = args.out[i * len(seeds) : (i + 1) * len(seeds)]
        results = finetune_seeds(
            args.checkpoint, task, data, seeds, args.protocol, outs, labels, args.precision,
            not args.quiet, args.cache_dir,
        )  # fmt: skip
        for result in results:
            print(task, result["seed"], json.dumps(result["scores"], sort_keys=True))
    return 0
