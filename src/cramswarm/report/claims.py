"""The papers' claims, checked: one declarative list of the qualitative claims of Cramming and SWARM, each with
the result files it reads, the statistical test it uses and a verdict function.

A claim's verdict is one of :data:`VERDICTS` and always comes from the result files:

* ``holds`` / ``does not hold``: the test says so at the claim's stated threshold;
* ``inconclusive at this scale``: the files are there but too few seeds (or sizes, or runs) to test, or the noise
  is larger than the effect;
* ``not run``: one of the claim's input files is absent (the experiment did not run).

The inputs are named by a *manifest* (a JSON object the workflow builds, ``cramswarm.workflow.report``'s
``claims_manifest()``) so that this module knows no paths of its own:

``source``
    the config's source (synthetic | hub), for the setup column;
``roles``
    ``{role: model name}`` for the roles ``crammed``, ``bert_original``, ``izsak``, ``no_pretrain``, ``swarm``
    (a role the config lacks is absent, and its claims are not run);
``main_vocab``
    the vocabulary size of the GLUE table's models;
``finetune``
    ``{"pattern", "tasks", "seeds", "ablation_tasks"}``: the fine-tuning result files (``pattern`` with the fields
    ``model``, ``vocab``, ``task``, ``seed``; the study's tasks, the seeds, the ablation runs' tasks);
``glue``
    ``{model: [vocab, ...]}``: the study's fine-tuned (model, vocab) pairs;
``checkpoints``
    ``{model: {vocab: checkpoint folder}}`` of the study's pretrained models (``summary.json``, ``train_log.csv``);
``arch``, ``schedule``
    ``{label: checkpoint folder}`` of the ablation runs (Figures 1 and 2);
``data``
    ``{run: {"source", "cell"}}`` of the Table 2 runs (fine-tuned on ``finetune.ablation_tasks``);
``swarm_study``
    ``{experiment: CSV}`` of the SWARM study (``results/swarm_study/<source>/``).

Tests (all one-sided at the claim's ``alpha`` unless said otherwise):

* **paired t-test over fine-tuning seeds** of the per-seed GLUE average (the mean of the paper's nine columns, or
  of those the config runs), against a margin; at least :data:`MIN_PAIRS` pairs, else inconclusive. ``holds`` if
  the difference is significantly above the margin, ``does not hold`` if significantly below, else inconclusive;
* **TOST equivalence** (two one-sided t-tests) for "about equal" claims: ``holds`` if the difference lies
  significantly inside ±margin, ``does not hold`` if significantly outside;
* **Spearman's ρ** (one-sided p) for monotone trends, with at least :data:`MIN_LEVELS` distinct levels;
* **single-run loss comparisons** (one pretraining seed per model): the difference of the final held-out MLM loss
  against the run's own noise, the standard deviation of its logged training loss over the last
  :data:`TAIL_SHARE` of the run (a conservative noise scale: it holds batch-to-batch noise, not seed-to-seed
  variance); a difference within that noise is inconclusive;
* **thresholds** stated in the claim, where an experiment writes one number per setting and no spread.

``docs/claims.md`` explains the columns and how to add a claim.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from cramswarm.io import read_json_object
from cramswarm.report.claim_tests import (
    COLUMNS,
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    LABELS,
    NOT_RUN,
    TAIL_SHARE,
    VERDICTS,
    Claim,
    MissingInput,
    Outcome,
    checkpoint_folder,
    common_columns,
    eval_loss_of,
    finetune_paths,
    glue_paths,
    glue_setup,
    loss_noise,
    paired_greater,
    per_seed_average,
    read_summary,
    role_model,
    run_files,
    shape_label,
    signed,
    tokens_label,
    trend,
)
from cramswarm.report.claims_swarm import (
    GLUE_MARGIN_POINTS,
    LOSS_MARGIN_NATS,
    WIRING_RATIO,
    compression_evaluate,
    failures_evaluate,
    rebalancing_evaluate,
    square_cube_evaluate,
    study_csv,
    swarm_glue_evaluate,
    swarm_glue_inputs,
    swarm_inputs,
    swarm_loss_evaluate,
    wiring_evaluate,
)
from cramswarm.report.tables import load_results, per_seed_scores, write_table

# ------------------------------------------------------------------------------------------ claim builders


def glue_gap(better: str, worse: str, *, margin: float, alpha: float) -> tuple[Callable, Callable]:
    """(inputs, evaluate) of "role ``better`` beats role ``worse`` on GLUE by more than ``margin`` points":
    a paired t-test over fine-tuning seeds of the per-seed GLUE average (columns both models ran)."""

    def inputs(manifest):
        return [*glue_paths(manifest, role_model(manifest, better)), *glue_paths(manifest, role_model(manifest, worse))]

    def evaluate(manifest):
        a, b = role_model(manifest, better), role_model(manifest, worse)
        frames = [per_seed_scores(load_results(glue_paths(manifest, m))) for m in (a, b)]
        columns = common_columns(frames)
        seeds = per_seed_average([*glue_paths(manifest, a), *glue_paths(manifest, b)], columns)
        wide = seeds.pivot(index="seed", columns="model", values="avg").dropna()
        outcome = paired_greater(wide[a] - wide[b], margin=margin, alpha=alpha, what="paired fine-tuning seeds")
        means = f"{a} {wide[a].mean():.1f}, {b} {wide[b].mean():.1f}; " if len(wide) else ""
        return Outcome(outcome.verdict, means + outcome.measurement, outcome.statistic,
                       glue_setup(manifest, seeds, (a, b)))

    return inputs, evaluate


def loss_gap(better: str, worse: str) -> tuple[Callable, Callable]:
    """(inputs, evaluate) of "role ``better`` reaches a lower held-out MLM loss than role ``worse`` at the same
    budget": single runs, the difference against both runs' training-loss noise (:func:`loss_noise`)."""

    def inputs(manifest):
        return [*run_files(checkpoint_folder(manifest, role_model(manifest, better))),
                *run_files(checkpoint_folder(manifest, role_model(manifest, worse)))]

    def evaluate(manifest):
        names = role_model(manifest, better), role_model(manifest, worse)
        folders = [checkpoint_folder(manifest, m) for m in names]
        summaries = [read_summary(f) for f in folders]
        losses = [eval_loss_of(s) for s in summaries]
        noise = max(loss_noise(f) for f in folders)
        delta = losses[1] - losses[0]  # positive: `better` has the lower loss
        measurement = (f"held-out MLM loss {names[0]} {losses[0]:.3f}, {names[1]} {losses[1]:.3f} nats; "
                       f"Δ = {signed(delta, 3)} (1 pretraining seed each)")
        statistic = f"|Δ| vs noise {noise:.3f} nats (training-loss sd over the last {TAIL_SHARE:.0%} of the log)"
        if not np.isfinite(delta) or not np.isfinite(noise):
            verdict = INCONCLUSIVE
        elif abs(delta) <= noise:
            verdict = INCONCLUSIVE
        else:
            verdict = HOLDS if delta > 0 else FAILS
        setup = (f"{manifest['source']}; vocab {manifest['main_vocab']}; "
                 + "; ".join(f"{n} {shape_label(s)}, {tokens_label(s)}" for n, s in zip(names, summaries)))
        return Outcome(verdict, measurement, statistic, setup)

    return inputs, evaluate


def _vocab_inputs(manifest):
    model = role_model(manifest, "crammed")
    vocabs = manifest.get("glue", {}).get(model, [])
    if not vocabs:
        raise MissingInput(f"the study fine-tunes no {model}")
    return [p for vocab in vocabs for p in glue_paths(manifest, model, vocab)]


def _vocab_evaluate(manifest):
    model = role_model(manifest, "crammed")
    seeds = per_seed_average(_vocab_inputs(manifest))
    seeds = seeds[seeds["model"] == model]
    verdict, statistic = trend(seeds["vocab"], seeds["avg"], increasing=True, what="vocab sizes")
    by_vocab = seeds.groupby("vocab")["avg"].agg(["median", "std", "size"])
    measurement = "; ".join(f"v{v}: {r['median']:.1f} ± {r['std']:.1f} (n={int(r['size'])})"
                            for v, r in by_vocab.iterrows()) + " (median ± sd of per-seed GLUE avg)"
    setup = (f"{manifest['source']}; {model} at vocab {', '.join(map(str, by_vocab.index))}; "
             f"{seeds['seed'].nunique()} fine-tuning seeds; GLUE avg over {int(seeds['n_columns'].iloc[0])} column(s)")
    return Outcome(verdict, measurement, statistic, setup)


def _runs(manifest, key):
    runs = manifest.get(key) or {}
    if not runs:
        raise MissingInput(f"the config defines no {key} ablation runs")
    return runs


def _arch_inputs(manifest):
    return [p for folder in _runs(manifest, "arch").values() for p in run_files(folder)]


def _arch_evaluate(manifest):
    runs = _runs(manifest, "arch")
    summaries = {label: read_summary(folder) for label, folder in runs.items()}
    params = [float(s["parameters"]) for s in summaries.values()]
    losses = [eval_loss_of(s) for s in summaries.values()]
    verdict, statistic = trend(params, losses, increasing=False, what="model sizes")
    order = sorted(zip(params, losses, summaries), key=lambda r: r[0])
    measurement = "; ".join(f"{label} {p / 1e6:.3g} M: {loss:.3f}" for p, loss, label in order)
    measurement += " (params: held-out MLM loss, nats; 1 pretraining seed each)"
    tokens = {s.get("tokens") for s in summaries.values()}
    setup = (f"{manifest['source']}; {len(runs)} arch runs at {', '.join(f'{t / 1e6:.3g} M' for t in tokens if t)} "
             f"tokens each; vocab {manifest['main_vocab']}")
    return Outcome(verdict, measurement, statistic, setup)


BUDGET_SHAPED = ("triangle", "one-cycle", "linear", "cosine")  # decay to (near) zero at the end of the budget
NOT_BUDGET_SHAPED = ("constant", "inverse-sqrt")  # no knowledge of where the budget ends


def _schedule_inputs(manifest):
    return [p for folder in _runs(manifest, "schedule").values() for p in run_files(folder)]


def _schedule_evaluate(manifest):
    runs = _runs(manifest, "schedule")
    rows = []
    for folder in runs.values():
        s = read_summary(folder)
        rows.append({"schedule": s["recipe"]["schedule"], "lr": float(s["recipe"]["lr"]), "loss": eval_loss_of(s),
                     "noise": loss_noise(folder)})
    table = pd.DataFrame(rows)
    shaped = table[table["schedule"].isin(BUDGET_SHAPED)]
    other = table[table["schedule"].isin(NOT_BUDGET_SHAPED)]
    setup = (f"{manifest['source']}; {len(table)} runs: schedules {', '.join(dict.fromkeys(table['schedule']))} x "
             f"peak LR {', '.join(f'{lr:g}' for lr in sorted(table['lr'].unique()))}; 1 pretraining seed each")
    if shaped.empty or other.empty:
        return Outcome(INCONCLUSIVE, "needs both a budget-shaped and a budget-free schedule",
                       "no comparison", setup)
    per_lr = (other.groupby("lr")["loss"].min() - shaped.groupby("lr")["loss"].min()).dropna()
    best = table.loc[table["loss"].idxmin()]
    noise = float(table["noise"].median())
    measurement = (f"lowest: {best['schedule']} at {best['lr']:g} ({best['loss']:.3f} nats); best budget-free minus "
                   f"best budget-shaped per peak LR: "
                   + ", ".join(f"{lr:g}: {signed(d, 3)}" for lr, d in per_lr.items()))
    statistic = (f"sign of the per-LR Δ at {len(per_lr)} peak LR(s); min |Δ| vs median noise {noise:.3f} nats "
                 f"(training-loss sd over the last {TAIL_SHARE:.0%})")
    if per_lr.empty or (per_lr.abs() <= noise).any():
        verdict = INCONCLUSIVE
    elif (per_lr > 0).all() and best["schedule"] in BUDGET_SHAPED:
        verdict = HOLDS
    elif (per_lr < 0).all():
        verdict = FAILS
    else:
        verdict = INCONCLUSIVE
    return Outcome(verdict, measurement, statistic, setup)


def data_gap(better_cell: str, worse_cell: str) -> tuple[Callable, Callable]:
    """(inputs, evaluate) of "cell ``better_cell`` beats ``worse_cell`` on fine-tuned GLUE" over the Table 2
    runs: pairs are (source, fine-tuning seed), a one-sided paired t-test of the per-seed average."""

    def cells(manifest):
        runs = _runs(manifest, "data")
        chosen = {run: spec for run, spec in runs.items() if spec["cell"] in (better_cell, worse_cell)}
        sources = {spec["source"] for spec in chosen.values() if spec["cell"] == better_cell}
        sources &= {spec["source"] for spec in chosen.values() if spec["cell"] == worse_cell}
        if not sources:
            raise MissingInput(f"no source has both cells {better_cell} and {worse_cell}")
        return {run: spec for run, spec in chosen.items() if spec["source"] in sources}

    def results(manifest, runs):
        return [p for run in runs for p in finetune_paths(manifest, run, manifest["main_vocab"], "ablation_tasks")]

    def inputs(manifest):
        return results(manifest, cells(manifest))

    def evaluate(manifest):
        runs = cells(manifest)
        seeds = per_seed_average(results(manifest, runs))
        seeds["source"] = seeds["model"].map({r: s["source"] for r, s in runs.items()})
        seeds["cell"] = seeds["model"].map({r: s["cell"] for r, s in runs.items()})
        wide = seeds.pivot_table(index=["source", "seed"], columns="cell", values="avg").dropna()
        outcome = paired_greater(wide[better_cell] - wide[worse_cell], what="(source, seed) pairs")
        per_source = wide.groupby(level="source").mean()
        means = "; ".join(f"{src}: {r[worse_cell]:.1f} → {r[better_cell]:.1f}" for src, r in per_source.iterrows())
        setup = (f"{manifest['source']}; sources {', '.join(per_source.index)}; {seeds['seed'].nunique()} "
                 f"fine-tuning seeds; avg over {int(seeds['n_columns'].iloc[0])} column(s); 1 pretraining run per cell")
        return Outcome(outcome.verdict, f"{means}; {outcome.measurement}", outcome.statistic, setup)

    return inputs, evaluate


# ---------------------------------------------------------------------------------------------- the claims

_bert_loss = loss_gap("crammed", "bert_original")
_izsak_loss = loss_gap("crammed", "izsak")
_bert_glue = glue_gap("crammed", "bert_original", margin=0.0, alpha=0.05)
_izsak_glue = glue_gap("crammed", "izsak", margin=0.0, alpha=0.05)
_pretraining = glue_gap("crammed", "no_pretrain", margin=5.0, alpha=0.01)
_filtering = data_gap("filtered", "none")
_sorting = data_gap("filtered_sorted", "filtered")

CLAIMS: tuple[Claim, ...] = (
    Claim("C1", "Cramming", "At equal budget the crammed recipe reaches a lower MLM loss than BERT's original recipe",
          "v1 §5, Tables 3/4 ('normal protocol' row)", "no per-row loss printed [paper]",
          "pretrain summary.json + train_log.csv: crammed, bert_original", "single-run held-out loss Δ vs noise",
          *_bert_loss),
    Claim("C2", "Cramming", "At equal budget the crammed recipe beats BERT's original recipe on GLUE",
          "v1 §5, Tables 3/4", "crammed 78.6 [paper]; 'normal protocol' row not found",
          "fine-tuning results: crammed, bert_original (main vocab)",
          "paired t-test over fine-tuning seeds, Δ > 0, α = 0.05", *_bert_glue),
    Claim("C3", "Cramming", "At equal budget the crammed recipe reaches a lower MLM loss than Izsak et al.'s",
          "v1 §5, Tables 3/4 (Izsak rows)", "Izsak rows not found",
          "pretrain summary.json + train_log.csv: crammed, izsak", "single-run held-out loss Δ vs noise",
          *_izsak_loss),
    Claim("C4", "Cramming", "At equal budget the crammed recipe beats Izsak et al.'s on GLUE",
          "v1 §5, Tables 3/4", "Izsak rows not found", "fine-tuning results: crammed, izsak (main vocab)",
          "paired t-test over fine-tuning seeds, Δ > 0, α = 0.05", *_izsak_glue),
    Claim("C5", "Cramming", "Pretraining beats no pretraining by a wide margin (≥ 5 GLUE points)",
          "v1 Tables 3/4, 'BERT-base (no pretrain)' row", "78.6 vs 45.5 [paper / third-party]",
          "fine-tuning results: crammed, no_pretrain (main vocab)",
          "paired t-test over fine-tuning seeds, Δ > 5 points, α = 0.01", *_pretraining),
    Claim("C6", "Cramming", "At a fixed token budget the loss is set by model size, not shape (Figure 1's curves "
          "collapse by size)", "v1 §4.2, Figure 1; ICML Table 11", "every architecture ends near MLM loss 1.9 [paper]",
          "ablation arch: summary.json per variant", "Spearman ρ(parameters, held-out loss) < 0, α = 0.05",
          _arch_inputs, _arch_evaluate),
    Claim("C7", "Cramming", "Schedules shaped to the budget (decaying to zero at its end) reach the lowest loss",
          "v1 §4.3, Figure 2", "one-cycle at peak 1e-3 lowest; no per-schedule values [paper]",
          "ablation schedule: summary.json + train_log.csv per run",
          "per peak LR: best budget-free minus best budget-shaped loss > noise at every LR", _schedule_inputs,
          _schedule_evaluate),
    Claim("C8", "Cramming", "GLUE rises with the vocabulary size", "v1 §4.4, Figure 3",
          "no per-size values printed; smaller vocabularies worse [paper]",
          "fine-tuning results: crammed at every vocab size", "Spearman ρ(vocab, per-seed GLUE avg) > 0, α = 0.05",
          _vocab_inputs, _vocab_evaluate),
    Claim("C9", "Cramming", "Filtering the corpus (uncompressibility filter) improves fine-tuned GLUE",
          "v1 §4.4, Table 2", "C4 75.9 → 79.3; Pile 78.2 → 79.3 [third-party, ICML]",
          "ablation data: fine-tuning results of cells none, filtered",
          "paired t-test over (source, seed), Δ > 0, α = 0.05", *_filtering),
    Claim("C10", "Cramming", "Sorting the filtered corpus helps further", "v1 §4.4, Table 2",
          "Pile 79.3 → 80.1; C4 79.3 → 79.0 [third-party, ICML]",
          "ablation data: fine-tuning results of cells filtered, filtered_sorted",
          "paired t-test over (source, seed), Δ > 0, α = 0.05", *_sorting),
    Claim("S1", "SWARM", "SWARM-trained reaches about the loss of single-process training (same model, data and "
          "budget)", "§4 (convergence), §3.2", "no number in our sources [unverified]",
          "summary.json + train_log.csv: swarm, crammed", f"|Δ held-out loss| ≤ {LOSS_MARGIN_NATS:g} nats",
          swarm_inputs, swarm_loss_evaluate),
    Claim("S2", "SWARM", "SWARM-trained fine-tunes about as well as single-process training", "§4 (convergence)",
          "no number in our sources [unverified]", "fine-tuning results: swarm, crammed (main vocab)",
          f"TOST over fine-tuning seeds, margin ±{GLUE_MARGIN_POINTS:g} points, α = 0.05", swarm_glue_inputs,
          swarm_glue_evaluate),
    Claim("S3", "SWARM", "Throughput-weighted stochastic wiring beats uniform routing on heterogeneous peers",
          "§3.1 (stochastic wiring)", "up to ~2.3x expected [proposal]", "swarm_study/wiring_throughput.csv",
          f"weighted / uniform ≥ {WIRING_RATIO:g} in every transport", study_csv("wiring_throughput"),
          wiring_evaluate),
    Claim("S4", "SWARM", "The swarm keeps training through peer failures, faster than fixed pipeline chains",
          "§3.1, §4 (throughput under failures)", "no number in our sources [unverified]",
          "swarm_study/failures_timeline.csv", "paired t-test over windows (weighted − fixed) > 0, α = 0.05; no "
          "stalled window", study_csv("failures_timeline"), failures_evaluate),
    Claim("S5", "SWARM", "Adaptive rebalancing restores the throughput of a starved stage", "§3.2, §4.3",
          "T = 300 s: 95.8 % of optimum vs 82.7 % without [secondary]", "swarm_study/rebalancing_recovery.csv",
          "paired t-test over late windows (rebalanced − off) > 0, α = 0.05", study_csv("rebalancing_recovery"),
          rebalancing_evaluate),
    Claim("S6", "SWARM", "The compute / communication ratio rises with layer width (square-cube law)",
          "§3 'square-cube law', Figure 1 (right)", "768: 18 %, 4096: 32 %, 12288: 82 % of time computing [paper]",
          "swarm_study/square_cube.csv", "Spearman ρ(width, compute/comm) > 0 per scheme, α = 0.05",
          study_csv("square_cube"), square_cube_evaluate),
    Claim("S7", "SWARM", "8-bit compression of activations and gradients costs about nothing in loss",
          "§4.2 / Appendix (compression)", "perplexities not found [unverified]", "swarm_study/compression_loss.csv",
          f"TOST over paired steps, margin ±{LOSS_MARGIN_NATS:g} nats, α = 0.05", study_csv("compression_loss"),
          compression_evaluate),
)


# ------------------------------------------------------------------------------------------------- table


def check(claim: Claim, manifest: Mapping) -> Outcome:
    """The claim's outcome: ``not run`` when the manifest lacks its inputs or one of its files is absent;
    otherwise what its verdict function derives from the files."""
    try:
        paths = claim.inputs(manifest)
    except MissingInput as exc:
        return Outcome(NOT_RUN, f"not measured: {exc}")
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        return Outcome(NOT_RUN, f"not measured: {len(missing)} of {len(paths)} input file(s) absent, e.g. {missing[0]}")
    return claim.evaluate(manifest)


def claims_table(manifest: Mapping, claims: Iterable[Claim] = CLAIMS) -> pd.DataFrame:
    """One row per claim: :data:`COLUMNS`."""
    rows = []
    for claim in claims:
        outcome = check(claim, manifest)
        rows.append({"id": claim.id, "paper": claim.paper, "claim": claim.claim, "where": claim.where,
                     "paper_number": claim.paper_number, "measurement": outcome.measurement, "test": claim.test,
                     "statistic": outcome.statistic, "verdict": outcome.verdict, "setup": outcome.setup,
                     "inputs": claim.reads})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _cell(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else \
        str(value).replace("|", "\\|").replace("\n", " ")


def to_markdown(table: pd.DataFrame, *, columns: Iterable[str] = COLUMNS) -> str:
    """A GitHub table of the claims (every cell exactly as in the CSV, ``|`` escaped) and a verdict count."""
    columns = list(columns)
    lines = ["| " + " | ".join(LABELS.get(c, c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for _, row in table.iterrows()]
    counts = table["verdict"].value_counts()
    lines += ["", "Verdicts: " + ", ".join(f"{v} {int(counts.get(v, 0))}" for v in VERDICTS) + "."]
    return "\n".join(lines) + "\n"


def inputs_record(manifest: Mapping, claims: Iterable[Claim] = CLAIMS) -> dict:
    """Where the table's numbers were made: over every input file present that records its provenance (the
    fine-tuning results and pretraining summaries), the code commits, the hardware (GPU, else CPU) and the span of
    finish times, with the count of files read."""
    paths: set[str] = set()
    for claim in claims:
        try:
            paths.update(claim.inputs(manifest))
        except MissingInput:
            continue
    commits, hardware, finished, present = set(), set(), [], 0
    for path in map(Path, sorted(paths)):
        if not path.is_file():
            continue
        present += 1
        if path.suffix != ".json":
            continue
        record = read_json_object(path, "claim input").get("provenance")
        if not isinstance(record, Mapping):
            continue
        if record.get("git_commit"):
            commits.add(record["git_commit"])
        machine = record.get("hardware") or {}
        if machine.get("gpu") or machine.get("cpu"):
            hardware.add(machine.get("gpu") or machine["cpu"])
        if record.get("finished_utc"):
            finished.append(record["finished_utc"])
    return {"git_commits": sorted(commits), "hardware": sorted(hardware), "input_files": present,
            "finished_utc": [min(finished), max(finished)] if finished else None}


def write_claims(manifest: Mapping, out_stem: str | os.PathLike) -> tuple[Path, ...]:
    """``<stem>.csv`` and ``<stem>.md``, atomically."""
    table = claims_table(manifest)
    return write_table(table, out_stem, markdown=to_markdown)
