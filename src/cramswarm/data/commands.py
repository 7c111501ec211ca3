"""Commands of the data stages: corpus, glue-data, tokenizer, filter, pack, order.

Options that mirror config keys take the schema's defaults (:func:`cramswarm.config.schema_default`).
"""

from __future__ import annotations

import json

from cramswarm.cli import arg, command, json_arg, report
from cramswarm.config import schema_default

SOURCE_SPEC = arg(
    "--source-spec", type=json_arg, required=True, help="JSON with the config's source, synthetic and hub sections"
)
OUT = arg("--out", required=True)
REPORT = arg("--report", help="also write the counts to this JSON file")


def memory_cap():
    return arg(
        "--memory-cap-mb",
        type=float,
        default=schema_default("data.memory_cap_mb"),
        help="working-set cap of the stage's batches (MiB; data.memory_cap_mb)",
    )


@command(
    "corpus",
    "write the pretraining corpus (parquet, one 'text' column) from the configured source",
    SOURCE_SPEC,
    OUT,
    REPORT,
    arg("--state-dir", help="hub source: where the stream's progress and written parts are kept, so that a killed "
        "job resumes (outside the outputs; removed at the end)"),
)
def corpus(args) -> int:
    from cramswarm.data import hub
    from cramswarm.data.sources import corpus_documents, write_corpus, write_corpus_resumable

    spec = args.source_spec
    if spec["source"] == "hub" and args.state_dir:
        stream = lambda state: hub.CorpusStream(spec["hub"]["corpus"], spec["hub"]["mirror"], state)  # noqa: E731
        counts = write_corpus_resumable(stream, args.out, args.state_dir, json.dumps(spec, sort_keys=True))
    else:  # the synthetic corpus is made again in seconds
        counts = write_corpus(corpus_documents(spec), args.out)
    report(args.report, {"source": args.source_spec["source"], **counts})
    return 0


@command(
    "glue-data",
    "write one GLUE task's train and validation splits (parquet) from the configured source",
    SOURCE_SPEC,
    OUT,
    REPORT,
    arg("--task", required=True),
)
def glue_data(args) -> int:
    from cramswarm.data.sources import write_glue

    counts = write_glue(args.source_spec, args.task, args.out)
    report(args.report, {"source": args.source_spec["source"], "task": args.task, "rows": counts})
    return 0


@command(
    "tokenizer",
    "train a tokenizer (WordPiece, BPE or Unigram) of exactly --vocab-size entries on the corpus",
    arg("--corpus", required=True),
    arg("--vocab-size", type=int, required=True),
    arg("--family", default=schema_default("tokenizer.family"), choices=("wordpiece", "bpe", "unigram")),
    arg("--min-frequency", type=int, default=schema_default("tokenizer.min_frequency")),
    arg("--cased", action="store_true", help="keep case and accents (tokenizer.lowercase: false)"),
    arg("--keep-non-ascii", action="store_true", help="keep non-ASCII characters (tokenizer.ascii_only: false)"),
    arg(
        "--limit-alphabet",
        type=int,
        default=schema_default("tokenizer.limit_alphabet"),
        help="most frequent characters kept (tokenizer.limit_alphabet)",
    ),
    OUT,
    arg("--report", help="also write the vocab facts to this JSON file"),
)
def tokenizer(args) -> int:
    from cramswarm.data import tokenizer as tokenization
    from cramswarm.io import atomic_path

    settings = {
        "family": args.family,
        "requested": args.vocab_size,
        "min_frequency": args.min_frequency,
        "lowercase": not args.cased,
        "ascii_only": not args.keep_non_ascii,
        "limit_alphabet": args.limit_alphabet,
    }
    # the corpus is read twice (alphabet, then training); any size problem is raised before the file is written
    tok = tokenization.train(
        lambda: tokenization.iter_corpus_batches(args.corpus, progress=True),
        args.vocab_size,
        args.family,
        settings["lowercase"],
        args.min_frequency,
        settings["ascii_only"],
        args.limit_alphabet,
        exact=True,
    )
    with atomic_path(args.out) as tmp:
        tok.save(str(tmp))
    facts = tokenization.vocab_facts(tok) | {"settings": settings, "corpus": args.corpus}
    facts["bit_reproducible"] = tokenization.REPRODUCIBLE[args.family]
    if not facts["bit_reproducible"]:
        facts["warnings"] = [
            f"{args.family} training is not bit-reproducible: the trainer sums piece scores in parallel, so two "
            "runs on the same corpus can differ in the last bits of the scores and in the order of tied pieces"
        ]
    report(args.report, facts)
    return 0


@command(
    "filter",
    "one raw-text filter step (trash or dedup) from corpus to corpus, with a report of rows in/out",
    arg("--kind", required=True, choices=("trash", "dedup")),
    arg("--corpus", required=True),
    arg("--tokenizer", help="trash: the corpus's own tokenizer (tokenizer.json)"),
    arg("--trash-cutoff", type=float, default=schema_default("data.trash_cutoff"), help="trash: tokens per character"),
    arg(
        "--dedup-threshold",
        type=float,
        default=schema_default("data.dedup_threshold"),
        help="dedup: Jaccard similarity",
    ),
    arg(
        "--shingle-words", type=int, default=schema_default("data.dedup_shingle_words"), help="dedup: words per shingle"
    ),
    arg("--num-perm", type=int, default=schema_default("data.dedup_permutations"), help="dedup: MinHash permutations"),
    arg("--workers", type=int, default=1, help="dedup: processes of its MinHash pass (the same output for any number)"),
    OUT,
    REPORT,
    memory_cap(),
)
def filter_corpus(args) -> int:
    from cramswarm.data import filters

    if args.kind == "trash":
        from cramswarm.data import tokenizer as tokenization

        if not args.tokenizer:
            raise ValueError("the trash filter needs --tokenizer (the corpus's own tokenizer)")
        tok = tokenization.load(args.tokenizer)
        counts = filters.trash_filter(args.corpus, tok, args.out, args.trash_cutoff, args.memory_cap_mb)
        counts["tokenizer"] = args.tokenizer
    else:
        counts = filters.dedup(args.corpus, args.out, args.dedup_threshold, args.shingle_words, args.num_perm,
                               workers=args.workers, memory_cap_mb=args.memory_cap_mb)
    report(args.report, {"corpus": args.corpus, **counts})
    return 0


@command(
    "pack",
    "tokenize the corpus and pack it into fixed-length blocks (.npy), streaming in bounded memory",
    arg("--corpus", required=True),
    arg("--tokenizer", required=True),
    arg("--block-tokens", type=int, default=schema_default("packing.block_tokens")),
    arg("--shuffle-seed", type=int, default=schema_default("packing.shuffle_seed")),
    OUT,
    REPORT,
    memory_cap(),
)
def pack(args) -> int:
    from cramswarm.data import packing
    from cramswarm.data import tokenizer as tokenization

    tok = tokenization.load(args.tokenizer)
    counts = packing.pack(
        args.corpus, tok, args.out, args.block_tokens, args.shuffle_seed, args.memory_cap_mb, progress=True
    )
    report(args.report, counts)
    return 0


@command(
    "order",
    "order packed blocks (random or a curriculum); the held-out sample goes last",
    arg("--packed", required=True),
    arg("--tokenizer", required=True),
    arg("--order", required=True, choices=("random", "sentence-length", "unigram", "unigram-reverse")),
    arg("--seed", type=int, default=schema_default("data.order_seed")),
    arg("--holdout-blocks", type=int, default=0, help="blocks of a random sample put last (held out)"),
    arg(
        "--max-training-blocks",
        type=int,
        default=schema_default("data.max_sequences"),
        help="keep only the first N training blocks of the order (data.max_sequences; default: all)",
    ),
    OUT,
    REPORT,
    memory_cap(),
)
def order(args) -> int:
    from cramswarm.data import ordering
    from cramswarm.data import tokenizer as tokenization

    tok = tokenization.load(args.tokenizer)
    counts = ordering.order_blocks(
        args.packed,
        tok,
        args.out,
        args.order,
        args.seed,
        args.holdout_blocks,
        args.memory_cap_mb,
        args.max_training_blocks,
    )
    report(args.report, counts)
    return 0
