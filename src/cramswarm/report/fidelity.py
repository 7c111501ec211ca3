"""The fidelity table: every setting of both published Cramming recipes and of the baselines as the reference code
runs them, the reference's value with its source file, ours as the resolved config gives it, and the verdict.

The reference's values and their source files are data (``fidelity_reference.yaml``, beside this module); ours is
read from the config files (``config/config.yaml`` + ``config/paper.yaml`` + the recipe overlay), and the two are
compared here, so no row can be typed "equal". A setting that differs from the reference without a reason under
the data file's ``known_differences`` is written as ``DIFFERS (undocumented)``, and ``tests/test_fidelity.py``
fails on it and on a committed table that is not what this module writes. Two rows describe the fine-tuning
code rather than a config value (its per-task warmup and its batching, ``cramswarm.glue.finetune``), which the
report may not import.
"""

from __future__ import annotations

from pathlib import Path

TASK_LABELS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "qqp": "QQP", "stsb": "STS-B", "mnli": "MNLI",
               "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI"}  # the papers' names of the GLUE tasks

REFERENCE_FILE = Path(__file__).with_name("fidelity_reference.yaml")

# (recipe, overlay files after config/config.yaml)
RECIPES = {
    "v1": ("config/paper.yaml", "config/recipes/cramming-v1.yaml"),
    "icml": ("config/paper.yaml", "config/recipes/cramming-icml.yaml"),
}


def reference(path: str | Path = REFERENCE_FILE) -> dict:
    """The reference's values (``fidelity_reference.yaml``): ``references`` (recipe -> repository@commit),
    ``settings`` (section, setting, the path of ours in :func:`_view`, per recipe the value and its source file) and
    ``known_differences`` (recipe or ``*``, section, setting, why ours differs)."""
    import yaml

    doc = yaml.safe_load(Path(path).read_text())
    paths = {(row["section"], row["setting"]): row["ours"] for row in doc["settings"]}
    for known in doc["known_differences"]:
        if (known["section"], known["setting"]) not in paths:
            raise ValueError(f"{path}: known difference {known['section']} / {known['setting']} names no setting")
    return doc


def _view(cfg: dict) -> dict:
    """Flat values of the resolved config, under the paths :data:`SPECS` name."""
    from cramswarm.config import glue_protocol, model_recipe

    view: dict = {}
    for name in ("crammed", "bert_original", "izsak"):
        r = model_recipe(cfg, name)
        for key, value in r.items():
            view[f"{name}.{key}"] = value
        view[f"mask.{name}"] = f"{r['mask_mode']} {r['mask_rate']:g}"
        arch = cfg["models"][name]["arch"]
        view[f"arch.{name}"] = [arch["layers"], arch["hidden_size"], arch["heads"], arch["intermediate_size"]]
        view[f"protocol.{name}"] = cfg["models"][name].get("glue_protocol") or cfg["glue"]["protocol"]
        horizon = r.get("schedule_horizon_sequences")
        view[f"horizon.{name}"] = (
            f"{r['schedule']}, warmup {_g(float(horizon['warmup']))} of {_g(float(horizon['total']))} sequences, "
            "cut by the budget"
            if horizon
            else f"{r['schedule']} over the budget, warmup {_g(r['warmup_fraction'])}"
        )
    crammed_arch = cfg["models"]["crammed"]["arch"]
    view["sparse.crammed"] = {
        True: "the masked ones (boolean gather)",
        False: "all",
        "static": f"a fixed {_g(crammed_arch.get('sparse_prediction_rate', 0.25))} of them, masked first",
    }[crammed_arch.get("sparse_prediction", True)]
    izsak_arch = cfg["models"]["izsak"]["arch"]
    view["izsak_arch.final_norm"] = izsak_arch.get("final_norm", True)
    view["izsak_arch.norm_eps"] = izsak_arch.get("norm_eps", 1e-12)
    r = model_recipe(cfg, "crammed")
    b = r["budget"]
    view["budget.crammed"] = (
        "one A6000-day (24 h x 154.8 TFLOP/s)"
        if b["unit"] == "seconds" and b["value"] == 86400 and b.get("reference_card") == "a6000"
        else f"{_g(b['value'])} {b['unit']} of {b.get('reference_card') or 'this device'}"
    )
    view["ramp.crammed"] = (
        f"{r['batch_ramp_micro_steps']} micro-steps"
        if r.get("batch_ramp_micro_steps")
        else f"{r['batch_ramp_fraction']:.0%} of the budget".replace("%", " %")
    )
    p = glue_protocol(cfg, "crammed")
    view["glue.crammed"] = (
        f"{p['epochs']} ep, batch {p['batch_size']}, {_g(p['lr'])}, {p['schedule']}, "
        f"{p['warmup_fraction']:.0%} warmup".replace("%", " %")
    )
    view["reference"] = cfg["glue"]["paper_reference"]
    view["hub.corpus.0.path"] = cfg["hub"]["corpus"][0]["path"]
    for key in ("trash_filter", "trash_cutoff", "dedup", "order"):
        view[f"data.{key}"] = cfg["data"][key]
    data = cfg["data"]
    view["data.dedup_method"] = (
        f"near-duplicate documents (MinHash, Jaccard {_g(data['dedup_threshold'])})" if data["dedup"] else "none"
    )
    view["data.trash_tokenizer"] = f"WordPiece {cfg['tokenizer']['main_vocab_size']} trained on the raw corpus"
    view["data.cap"] = data.get("max_sequences")
    view["data.documents"] = cfg["hub"]["corpus"][0]["max_documents"]
    view["precision.crammed"] = r["precision"]
    warmup_task = p.get("warmup_from_task")  # cramswarm.glue.finetune.warmup_steps
    view["glue.warmup_per_task"] = (f"{TASK_LABELS[warmup_task]}'s warmup steps reused for every task" if warmup_task
                                    else "each task's own share of its steps")
    view["glue.batching"] = "length-bucketed, last partial batch kept"
    view["data.baselines"] = view["hub.corpus.0.path"]
    view["packing.block_tokens"] = cfg["packing"]["block_tokens"]
    view["tokenizer.main_vocab_size"] = cfg["tokenizer"]["main_vocab_size"]
    tok = cfg["tokenizer"]
    view["tokenizer.family"] = {"wordpiece": "WordPiece", "bpe": "BPE", "unigram": "Unigram"}[tok["family"]]
    steps = ["quotes", "NFD"] + (["lowercase", "strip accents"] if tok["lowercase"] else []) + ["collapse spaces"]
    view["tokenizer.normaliser"] = ", ".join(steps + (["delete non-ASCII"] if tok["ascii_only"] else []))
    view["tokenizer.pre_tokenizer"] = "BERT (every punctuation character split off)"
    return view


def _g(value: float) -> str:
    """Shortest number text: 4e-5, 5.12e6, 0.25."""
    return f"{value:g}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= 1e-12 * max(abs(float(a)), abs(float(b)), 1.0)
        except (TypeError, ValueError):
            return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _fmt(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        return _g(value)
    if isinstance(value, (list, tuple)):
        return (
            " x ".join(_fmt(v) for v in value)
            if all(isinstance(v, int) for v in value)
            else "(" + ", ".join(_fmt(v) for v in value) + ")"
        )
    return str(value)


def rows(repo: str | Path = ".", reference_file: str | Path = REFERENCE_FILE) -> list[dict]:
    """One row per (recipe, setting): reference value and source, ours, verdict."""
    from cramswarm.config import load_config

    repo, ref = Path(repo), reference(reference_file)
    known = {(k["recipe"], k["section"], k["setting"]): k["why"] for k in ref["known_differences"]}
    out = []
    for recipe, overlays in RECIPES.items():
        cfg = load_config([repo / "config" / "config.yaml", *(repo / o for o in overlays)], base_dir=repo)
        view = _view(cfg)
        for spec in ref["settings"]:
            if recipe not in spec:
                continue
            section, setting = spec["section"], spec["setting"]
            reference_value = spec[recipe]["value"]
            source = f"{ref['references'][recipe]} {spec[recipe]['source']}"
            ours = view[spec["ours"]]
            if _same(ours, reference_value):
                verdict = "equal"
            else:
                reason = known.get((recipe, section, setting)) or known.get(("*", section, setting))
                verdict = f"differs: {reason}" if reason else "DIFFERS (undocumented)"
            out.append(
                {
                    "recipe": recipe,
                    "section": section,
                    "setting": setting,
                    "reference": _fmt(reference_value),
                    "source": source,
                    "ours": _fmt(ours),
                    "verdict": verdict,
                }
            )
    return out


def markdown(table: list[dict]) -> str:
    lines = [
        "# Fidelity to the reference code",
        "",
        "<!-- written by `python -m cramswarm fidelity-table --out docs/fidelity.md` from the config files; "
        "tests/test_fidelity.py fails when this file is not what the command writes -->",
        "",
        "Every setting of the two published Cramming recipes and of the baselines as the reference code runs them,",
        "against what `config/config.yaml` + `config/paper.yaml` + the recipe overlay resolve to. `v1`:",
        "`config/recipes/cramming-v1.yaml` (the same as `config/paper.yaml` alone); `icml`:",
        "`config/recipes/cramming-icml.yaml`. Sources are files of the reference repository at the named commit;",
        "the reference's values are data (`src/cramswarm/report/fidelity_reference.yaml`), compared with ours by code.",
        "How budgets are normalised and how the baselines are run: docs/recipes.md.",
        "",
    ]
    for recipe in RECIPES:
        lines += [
            f"## {recipe}",
            "",
            "| Section | Setting | Reference | Source | Ours | Verdict |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['section']} | {r['setting']} | {r['reference']} | {r['source']} | {r['ours']} | {r['verdict']} |"
            for r in table
            if r["recipe"] == recipe
        ]
        lines.append("")
    return "\n".join(lines)
