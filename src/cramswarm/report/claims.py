"""The papers' claims, checked: one declarative list of the qualitative claims of Cramming and SWARM, each with
the result files it reads, the statistical test it uses and a verdict function.

A claim's verdict is one of :data:`VERDICTS` and always comes from the result files:

* ``holds`` / ``does not hold``: the test says so at the claim's stated threshold;
* ``inconclusive at this scale``: the files are there but too few seeds (or sizes, or runs) to test, or the noise
  is larger than the effect;
* ``not run``: one of the claim's input files is absent (the experiment did not run).

The inputs are named by a *manifest* (a JSON object the workflow builds in ``rules/common.smk``,
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from cramswarm.glue.metrics import PAPER_AVERAGE_COLUMNS
from cramswarm.io import read_json_object
from cramswarm.report.recovery import late_windows
from cramswarm.report.tables import load_results, per_seed_scores, write_table

HOLDS = "holds"
FAILS = "does not hold"
INCONCLUSIVE = "inconclusive at this scale"
NOT_RUN = "not run"
VERDICTS = (HOLDS, FAILS, INCONCLUSIVE, NOT_RUN)

MIN_PAIRS = 3  # paired tests need at least this many pairs (seeds)
MIN_LEVELS = 3  # trend tests need at least this many distinct levels (vocab sizes, widths, runs)
TAIL_SHARE = 0.2  # share of the logged training rows (the last ones) whose loss spread is a run's noise scale

COLUMNS = ("id", "paper", "claim", "where", "paper_number", "measurement", "test", "statistic", "verdict", "setup",
           "inputs")
LABELS = {
    "id": "ID",
    "paper": "Paper",
    "claim": "Claim",
    "where": "Where in the paper",
    "paper_number": "Paper's number",
    "measurement": "Our measurement",
    "test": "Test",
    "statistic": "Statistic",
    "verdict": "Verdict",
    "setup": "Setup",
    "inputs": "Inputs",
}


@dataclass(frozen=True)
class Outcome:
    """What a verdict function found: the verdict, our measurement (with seeds and spread), the test statistic
    and the setup it was measured on."""

    verdict: str
    measurement: str
    statistic: str = ""
    setup: str = ""

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}; one of {VERDICTS}")


@dataclass(frozen=True)
class Claim:
    """One claim of a paper. ``inputs(manifest)`` lists the files it reads (all must exist, else ``not run``);
    ``evaluate(manifest)`` returns the :class:`Outcome`; ``reads`` names the result files for the table."""

    id: str
    paper: str
    claim: str
    where: str
    paper_number: str
    reads: str
    test: str
    inputs: Callable[[Mapping], list[str]]
    evaluate: Callable[[Mapping], Outcome]


class MissingInput(LookupError):
    """The manifest lacks what a claim needs (a role or experiment the config does not define)."""


# --------------------------------------------------------------------------------------------- statistics


def _fmt(value: float, digits: int = 2) -> str:
    return "NaN" if value is None or not np.isfinite(value) else f"{value:+.{digits}f}"


def _p(value: float) -> str:
    return "NaN" if not np.isfinite(value) else (f"{value:.2g}" if value >= 1e-4 else "<1e-4")


def _constant(d: np.ndarray) -> bool:
    """Every value equal up to float rounding (a t statistic would be undefined or meaningless)."""
    return bool(np.ptp(d) <= 1e-9 * max(1.0, float(np.abs(d).max())))


def _paired(diffs: Iterable[float], unit: str, what: str, *, mean_digits: int,
            spread_format: str) -> tuple[np.ndarray, str, Outcome | None]:
    """The finite differences, the measurement text (mean ± sd over n), and an inconclusive outcome when there
    are too few pairs to test (else None)."""
    d = np.asarray([x for x in diffs if np.isfinite(x)], dtype=float)
    n = len(d)
    if n == 0:
        return d, "", Outcome(INCONCLUSIVE, "no finite paired differences")
    spread = format(d.std(ddof=1), spread_format) if n > 1 else "NaN"
    measurement = f"Δ = {_fmt(d.mean(), mean_digits)} {unit} (mean ± sd {spread} over {n} {what})"
    if n < MIN_PAIRS:
        return d, measurement, Outcome(INCONCLUSIVE, measurement, f"{n} pair(s): fewer than {MIN_PAIRS}")
    return d, measurement, None


def paired_greater(diffs: Iterable[float], *, margin: float = 0.0, alpha: float = 0.05, unit: str = "points",
                   what: str = "seeds") -> Outcome:
    """One-sided paired t-test of ``diffs`` (one per pair) against ``margin``: holds if the mean difference is
    significantly above it, does not hold if significantly below, else inconclusive."""
    d, measurement, early = _paired(diffs, unit, what, mean_digits=2, spread_format=".2f")
    if early:
        return early
    n = len(d)
    if _constant(d):  # every pair equal: the t statistic is undefined, the data are not
        verdict = HOLDS if d[0] > margin else FAILS if d[0] < margin else INCONCLUSIVE
        return Outcome(verdict, measurement, f"all {n} differences equal ({_fmt(d[0])}); margin {margin:g}")
    above = stats.ttest_1samp(d, margin, alternative="greater")
    below = stats.ttest_1samp(d, margin, alternative="less")
    statistic = (f"t({n - 1}) = {above.statistic:.2f} vs margin {margin:g}; p(Δ > margin) = {_p(above.pvalue)}, "
                 f"p(Δ < margin) = {_p(below.pvalue)}; α = {alpha:g}")
    if above.pvalue < alpha:
        return Outcome(HOLDS, measurement, statistic)
    if below.pvalue < alpha:
        return Outcome(FAILS, measurement, statistic)
    return Outcome(INCONCLUSIVE, measurement, statistic)


def equivalent(diffs: Iterable[float], *, margin: float, alpha: float = 0.05, unit: str = "points",
               what: str = "seeds") -> Outcome:
    """TOST: holds if the mean difference lies significantly within ±``margin``; does not hold if it lies
    significantly outside; else inconclusive."""
    d, measurement, early = _paired(diffs, unit, what, mean_digits=3, spread_format=".3g")
    if early:
        return early
    n = len(d)
    if _constant(d):
        verdict = HOLDS if abs(d[0]) < margin else FAILS
        return Outcome(verdict, measurement, f"all {n} differences equal ({_fmt(d[0], 3)}); margin ±{margin:g}")
    lower = stats.ttest_1samp(d, -margin, alternative="greater").pvalue
    upper = stats.ttest_1samp(d, margin, alternative="less").pvalue
    beyond = min(stats.ttest_1samp(d, margin, alternative="greater").pvalue,
                 stats.ttest_1samp(d, -margin, alternative="less").pvalue)
    statistic = (f"TOST margin ±{margin:g} {unit}: p = {_p(max(lower, upper))}; p(outside) = {_p(beyond)}; "
                 f"α = {alpha:g}")
    if max(lower, upper) < alpha:
        return Outcome(HOLDS, measurement, statistic)
    if beyond < alpha:
        return Outcome(FAILS, measurement, statistic)
    return Outcome(INCONCLUSIVE, measurement, statistic)


def trend(x: Iterable[float], y: Iterable[float], *, increasing: bool, alpha: float = 0.05,
          what: str = "levels") -> tuple[str, str]:
    """(verdict, statistic) of a one-sided Spearman test that ``y`` rises (``increasing``) or falls with ``x``."""
    x, y = np.asarray(list(x), dtype=float), np.asarray(list(y), dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    levels = len(np.unique(x))
    if levels < MIN_LEVELS:
        return INCONCLUSIVE, f"{levels} distinct {what}: fewer than {MIN_LEVELS}"
    if len(np.unique(y)) == 1:
        return INCONCLUSIVE, "every value equal: no trend to rank"
    with_ = stats.spearmanr(x, y, alternative="greater" if increasing else "less")
    against = stats.spearmanr(x, y, alternative="less" if increasing else "greater")
    statistic = (f"Spearman ρ = {with_.statistic:+.2f} over {len(x)} points ({levels} {what}); "
                 f"p(claimed direction) = {_p(with_.pvalue)}, p(opposite) = {_p(against.pvalue)}; α = {alpha:g}")
    if with_.pvalue < alpha:
        return HOLDS, statistic
    if against.pvalue < alpha:
        return FAILS, statistic
    return INCONCLUSIVE, statistic


# ------------------------------------------------------------------------------------------------ readers


def _summary(folder: str | os.PathLike) -> dict:
    return read_json_object(Path(folder) / "summary.json", "pretraining summary", missing=ValueError)


def loss_noise(folder: str | os.PathLike) -> float:
    """Standard deviation (ddof=1) of the logged training loss over the last :data:`TAIL_SHARE` of a run's rows."""
    log = pd.read_csv(Path(folder) / "train_log.csv")
    loss = pd.to_numeric(log["loss"], errors="coerce").dropna()
    tail = loss.iloc[-max(2, math.ceil(TAIL_SHARE * len(loss))):]
    return float(tail.std(ddof=1)) if len(tail) > 1 else math.nan


def _eval_loss(summary: dict) -> float:
    value = summary.get("eval_loss")
    return math.nan if value is None else float(value)


def _shape(summary: dict) -> str:
    arch = summary.get("arch", {})
    params = summary.get("parameters")
    size = f", {params / 1e6:.3g} M params" if params else ""
    return f"{arch.get('layers', '?')}x{arch.get('hidden_size', '?')}{size}"


def _tokens(summary: dict) -> str:
    tokens = summary.get("tokens")
    return f"{tokens / 1e6:.3g} M tokens" if tokens else "? tokens"


def per_seed_average(paths: Iterable[str | os.PathLike], columns: Iterable[str] | None = None) -> pd.DataFrame:
    """Per (model, vocab, seed): ``avg``, the mean of the paper's score columns present (or ``columns``), and
    ``n_columns``. A seed lacking one of those columns gets NaN (never an average over fewer numbers)."""
    seeds = per_seed_scores(load_results(paths))
    present = [c for c in PAPER_AVERAGE_COLUMNS if c in seeds.columns and seeds[c].notna().any()]
    use = list(columns) if columns is not None else present
    seeds["avg"] = seeds[use].mean(axis=1, skipna=False) if use else math.nan
    seeds["n_columns"] = len(use)
    return seeds


def _common_columns(frames: Iterable[pd.DataFrame]) -> list[str]:
    common = None
    for frame in frames:
        have = {c for c in PAPER_AVERAGE_COLUMNS if c in frame.columns and frame[c].notna().all()}
        common = have if common is None else common & have
    return [c for c in PAPER_AVERAGE_COLUMNS if c in (common or set())]


def _role(manifest: Mapping, role: str) -> str:
    name = manifest.get("roles", {}).get(role)
    if not name:
        raise MissingInput(f"the config defines no {role} model")
    return name


def finetune_paths(manifest: Mapping, model: str, vocab: int, tasks: str = "tasks") -> list[str]:
    """The fine-tuning result files of (``model``, ``vocab``): the manifest's ``finetune.pattern`` for every task
    of ``finetune.<tasks>`` and every seed of ``finetune.seeds``."""
    spec = manifest.get("finetune") or {}
    if not spec.get("pattern") or not spec.get(tasks) or not spec.get("seeds"):
        raise MissingInput(f"the manifest names no fine-tuning result files ({tasks})")
    return [spec["pattern"].format(model=model, vocab=vocab, task=task, seed=seed)
            for task in spec[tasks] for seed in spec["seeds"]]


def _glue_paths(manifest: Mapping, model: str, vocab: int | None = None) -> list[str]:
    vocab = manifest["main_vocab"] if vocab is None else vocab
    if int(vocab) not in [int(v) for v in manifest.get("glue", {}).get(model, [])]:
        raise MissingInput(f"the study fine-tunes no {model} at vocab {vocab}")
    return finetune_paths(manifest, model, vocab)


def _checkpoint(manifest: Mapping, model: str, vocab: int | None = None) -> str:
    vocab = manifest["main_vocab"] if vocab is None else vocab
    folder = manifest.get("checkpoints", {}).get(model, {}).get(str(vocab))
    if not folder:
        raise MissingInput(f"no checkpoint of {model} at vocab {vocab} in the manifest")
    return folder


def _run_files(folder: str) -> list[str]:
    return [f"{folder}/summary.json", f"{folder}/train_log.csv"]


def _glue_setup(manifest: Mapping, seeds: pd.DataFrame, models: Iterable[str]) -> str:
    n_seeds = seeds["seed"].nunique()
    n_cols = int(seeds["n_columns"].iloc[0]) if len(seeds) else 0
    return (f"{manifest['source']}; vocab {manifest['main_vocab']}; {', '.join(models)}; "
            f"{n_seeds} fine-tuning seeds; GLUE avg over {n_cols} paper column(s)")


# ------------------------------------------------------------------------------------------ claim builders


def glue_gap(better: str, worse: str, *, margin: float, alpha: float) -> tuple[Callable, Callable]:
    """(inputs, evaluate) of "role ``better`` beats role ``worse`` on GLUE by more than ``margin`` points":
    a paired t-test over fine-tuning seeds of the per-seed GLUE average (columns both models ran)."""

    def inputs(manifest):
        return [*_glue_paths(manifest, _role(manifest, better)), *_glue_paths(manifest, _role(manifest, worse))]

    def evaluate(manifest):
        a, b = _role(manifest, better), _role(manifest, worse)
        frames = [per_seed_scores(load_results(_glue_paths(manifest, m))) for m in (a, b)]
        columns = _common_columns(frames)
        seeds = per_seed_average([*_glue_paths(manifest, a), *_glue_paths(manifest, b)], columns)
        wide = seeds.pivot(index="seed", columns="model", values="avg").dropna()
        outcome = paired_greater(wide[a] - wide[b], margin=margin, alpha=alpha, what="paired fine-tuning seeds")
        means = f"{a} {wide[a].mean():.1f}, {b} {wide[b].mean():.1f}; " if len(wide) else ""
        return Outcome(outcome.verdict, means + outcome.measurement, outcome.statistic,
                       _glue_setup(manifest, seeds, (a, b)))

    return inputs, evaluate


def loss_gap(better: str, worse: str) -> tuple[Callable, Callable]:
    """(inputs, evaluate) of "role ``better`` reaches a lower held-out MLM loss than role ``worse`` at the same
    budget": single runs, the difference against both runs' training-loss noise (:func:`loss_noise`)."""

    def inputs(manifest):
        return [*_run_files(_checkpoint(manifest, _role(manifest, better))),
                *_run_files(_checkpoint(manifest, _role(manifest, worse)))]

    def evaluate(manifest):
        names = _role(manifest, better), _role(manifest, worse)
        folders = [_checkpoint(manifest, m) for m in names]
        summaries = [_summary(f) for f in folders]
        losses = [_eval_loss(s) for s in summaries]
        noise = max(loss_noise(f) for f in folders)
        delta = losses[1] - losses[0]  # positive: `better` has the lower loss
        measurement = (f"held-out MLM loss {names[0]} {losses[0]:.3f}, {names[1]} {losses[1]:.3f} nats; "
                       f"Δ = {_fmt(delta, 3)} (1 pretraining seed each)")
        statistic = f"|Δ| vs noise {noise:.3f} nats (training-loss sd over the last {TAIL_SHARE:.0%} of the log)"
        if not np.isfinite(delta) or not np.isfinite(noise):
            verdict = INCONCLUSIVE
        elif abs(delta) <= noise:
            verdict = INCONCLUSIVE
        else:
            verdict = HOLDS if delta > 0 else FAILS
        setup = (f"{manifest['source']}; vocab {manifest['main_vocab']}; "
                 + "; ".join(f"{n} {_shape(s)}, {_tokens(s)}" for n, s in zip(names, summaries)))
        return Outcome(verdict, measurement, statistic, setup)

    return inputs, evaluate


def _vocab_inputs(manifest):
    model = _role(manifest, "crammed")
    vocabs = manifest.get("glue", {}).get(model, [])
    if not vocabs:
        raise MissingInput(f"the study fine-tunes no {model}")
    return [p for vocab in vocabs for p in _glue_paths(manifest, model, vocab)]


def _vocab_evaluate(manifest):
    model = _role(manifest, "crammed")
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
    return [p for folder in _runs(manifest, "arch").values() for p in _run_files(folder)]


def _arch_evaluate(manifest):
    runs = _runs(manifest, "arch")
    summaries = {label: _summary(folder) for label, folder in runs.items()}
    params = [float(s["parameters"]) for s in summaries.values()]
    losses = [_eval_loss(s) for s in summaries.values()]
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
    return [p for folder in _runs(manifest, "schedule").values() for p in _run_files(folder)]


def _schedule_evaluate(manifest):
    runs = _runs(manifest, "schedule")
    rows = []
    for folder in runs.values():
        s = _summary(folder)
        rows.append({"schedule": s["recipe"]["schedule"], "lr": float(s["recipe"]["lr"]), "loss": _eval_loss(s),
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
                   + ", ".join(f"{lr:g}: {_fmt(d, 3)}" for lr, d in per_lr.items()))
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


def _swarm_inputs(manifest):
    return [*_run_files(_checkpoint(manifest, _role(manifest, "swarm"))),
            *_run_files(_checkpoint(manifest, _role(manifest, "crammed")))]


LOSS_MARGIN_NATS = 0.05  # "about equal" in held-out / training MLM loss (nats per token)
GLUE_MARGIN_POINTS = 1.0  # "about equal" in GLUE average (points)


def _same_arch(a: dict, b: dict) -> bool:
    return a.get("arch") == b.get("arch") and a.get("parameters") == b.get("parameters")


def _swarm_loss_evaluate(manifest):
    names = _role(manifest, "swarm"), _role(manifest, "crammed")
    folders = [_checkpoint(manifest, m) for m in names]
    summaries = [_summary(f) for f in folders]
    losses = [_eval_loss(s) for s in summaries]
    noise = max(loss_noise(f) for f in folders)
    delta = losses[0] - losses[1]
    measurement = (f"held-out MLM loss {names[0]} {losses[0]:.3f}, {names[1]} {losses[1]:.3f} nats; "
                   f"Δ = {_fmt(delta, 3)} (1 pretraining seed each)")
    statistic = f"|Δ| vs margin {LOSS_MARGIN_NATS:g} nats; noise {noise:.3f} nats"
    setup = (f"{manifest['source']}; " + "; ".join(f"{n} {_shape(s)}, {_tokens(s)}" for n, s in zip(names, summaries))
             + "; swarm: " + ", ".join(f"{k} {summaries[0].get('swarm', {}).get(k)}"
                                       for k in ("stages", "peers_per_stage", "compression")))
    if not _same_arch(*summaries):
        return Outcome(INCONCLUSIVE, measurement, statistic + "; the two models differ in shape: not comparable",
                       setup)
    if not np.isfinite(delta):
        verdict = INCONCLUSIVE
    elif abs(delta) <= LOSS_MARGIN_NATS:
        verdict = HOLDS
    elif abs(delta) > LOSS_MARGIN_NATS + noise:
        verdict = FAILS
    else:
        verdict = INCONCLUSIVE
    return Outcome(verdict, measurement, statistic, setup)


def _swarm_glue_inputs(manifest):
    return [*_glue_paths(manifest, _role(manifest, "swarm")), *_glue_paths(manifest, _role(manifest, "crammed")),
            *_swarm_inputs(manifest)]


def _swarm_glue_evaluate(manifest):
    a, b = _role(manifest, "swarm"), _role(manifest, "crammed")
    frames = [per_seed_scores(load_results(_glue_paths(manifest, m))) for m in (a, b)]
    seeds = per_seed_average([*_glue_paths(manifest, a), *_glue_paths(manifest, b)], _common_columns(frames))
    wide = seeds.pivot(index="seed", columns="model", values="avg").dropna()
    outcome = equivalent(wide[a] - wide[b], margin=GLUE_MARGIN_POINTS, what="paired fine-tuning seeds")
    summaries = [_summary(_checkpoint(manifest, m)) for m in (a, b)]
    setup = _glue_setup(manifest, seeds, (a, b))
    if not _same_arch(*summaries):
        return Outcome(INCONCLUSIVE, outcome.measurement,
                       outcome.statistic + "; the two models differ in shape: not comparable", setup)
    return Outcome(outcome.verdict, outcome.measurement, outcome.statistic, setup)


def _study_csv(name: str) -> Callable:
    def inputs(manifest):
        path = manifest.get("swarm_study", {}).get(name)
        if not path:
            raise MissingInput(f"the swarm study has no {name} experiment")
        return [path]

    return inputs


def _read_study(manifest, name) -> pd.DataFrame:
    return pd.read_csv(_study_csv(name)(manifest)[0], na_values=["NaN"])


WIRING_RATIO = 1.1  # weighted must beat uniform by this factor in every transport


def _wiring_evaluate(manifest):
    data = _read_study(manifest, "wiring_throughput")
    if "run" in data.columns:   # the claim is about the configured setup; the load sweep is reported beside it
        data = data[data["run"] == "base"]
    ratios = {}
    for transport, rows in data.groupby("transport", sort=False):
        by = rows.set_index("routing")["throughput_mb_s"]
        if "weighted" in by and "uniform" in by and by["uniform"] > 0:
            ratios[transport] = float(by["weighted"] / by["uniform"])
    first = data.iloc[0]
    setup = (f"{int(first['stages'])} stages, {int(first['peers'])} peers of mixed speed, {int(first['trainers'])} "
             f"trainers, {first['duration_s']:g} emulated s; 1 run per routing and transport")
    measurement = "weighted / uniform throughput: " + (", ".join(f"{t} {r:.2f}x" for t, r in ratios.items())
                                                        or "no pair")
    statistic = f"threshold: ratio ≥ {WIRING_RATIO:g} in every transport (one run each: no spread)"
    if not ratios:
        verdict = INCONCLUSIVE
    elif all(r >= WIRING_RATIO for r in ratios.values()):
        verdict = HOLDS
    elif all(r <= 1.0 for r in ratios.values()):
        verdict = FAILS
    else:
        verdict = INCONCLUSIVE
    return Outcome(verdict, measurement, statistic, setup)


def _failures_evaluate(manifest):
    data = _read_study(manifest, "failures_timeline")
    killed = data[data["failures"] == "periodic"]
    wide = killed.pivot_table(index=["transport", "t_s"], columns="routing", values="throughput_mb_s")
    if not {"weighted", "fixed"} <= set(wide.columns):
        return Outcome(INCONCLUSIVE, "needs weighted and fixed routing under failures", "no comparison",
                       f"{killed['transport'].nunique()} transport(s); periodic kills")
    wide = wide.dropna()  # a transport without fixed chains (the testbed's launcher) has no pair
    paired = list(dict.fromkeys(wide.index.get_level_values("transport")))
    unpaired = sorted(set(killed["transport"]) - set(paired))
    setup = (f"transports {', '.join(paired)}; periodic kills; {killed['t_s'].nunique()} windows of "
             f"{killed['window_s'].iloc[0]:g} s (emulated s in the emulation and the simulator)"
             + (f"; {', '.join(unpaired)} left out: no fixed chains" if unpaired else ""))
    later = killed[(killed["routing"] == "weighted") & (killed["t_s"] > killed["t_s"].min())]
    stalls = int((later["throughput_mb_s"] <= 0).sum())
    lost = int(killed.loc[killed["routing"] == "weighted", "lost_microbatches"].max())
    outcome = paired_greater(wide["weighted"] - wide["fixed"], unit="microbatches/s", what="(transport, window) pairs")
    measurement = (f"under kills: weighted {wide['weighted'].mean():.2f}, fixed chains {wide['fixed'].mean():.2f} "
                   f"microbatches/s; {outcome.measurement}; weighted windows at zero after the first: {stalls}; "
                   f"lost microbatches: {lost}")
    statistic = outcome.statistic + "; and no window after the first at zero throughput"
    if stalls:
        verdict = FAILS
    else:
        verdict = outcome.verdict
    return Outcome(verdict, measurement, statistic, setup)


def _rebalancing_evaluate(manifest):
    data = _read_study(manifest, "rebalancing_recovery")
    kill_at, late = late_windows(data)
    late["period"] = late["rebalance_period_s"].map(lambda p: "off" if pd.isna(p) else f"{p:g}")
    wide = late.pivot_table(index=["transport", "t_s"], columns="period", values="throughput_mb_s")
    periods = [c for c in wide.columns if c != "off"]
    setup = (f"{data['transport'].nunique()} transport(s); a stage starved at {kill_at:g} emulated s; rebalancing "
             f"off vs every {', '.join(periods)} s; windows of the last half after the kill")
    if "off" not in wide.columns or not periods:
        return Outcome(INCONCLUSIVE, "needs rebalancing off and on", "no comparison", setup)
    diffs = pd.concat([wide[p] - wide["off"] for p in periods]).dropna()
    outcome = paired_greater(diffs, unit="microbatches/s", what="(transport, period, window) pairs")
    means = ", ".join(f"{p}: {wide[p].mean():.2f}" for p in ["off", *periods])
    return Outcome(outcome.verdict, f"late throughput {means} microbatches/s; {outcome.measurement}",
                   outcome.statistic, setup)


def _square_cube_evaluate(manifest):
    data = _read_study(manifest, "square_cube")
    bandwidth = data["bandwidth_mbit_s"].min()  # the ratio at one link (the slowest, with no added delay)
    rows = data[data["bandwidth_mbit_s"] == bandwidth]
    if "latency_ms" in rows:
        rows = rows[rows["latency_ms"] == rows["latency_ms"].min()]
    results = {}
    for scheme, group in rows.groupby("scheme", sort=False):
        results[scheme] = trend(group["hidden_size"], group["compute_to_comm"], increasing=True, what="widths")
    verdicts = [v for v, _ in results.values()]
    verdict = HOLDS if all(v == HOLDS for v in verdicts) else FAILS if FAILS in verdicts else INCONCLUSIVE
    sizes = sorted(rows["hidden_size"].unique())
    ratio = rows.pivot_table(index="hidden_size", columns="scheme", values="compute_to_comm")
    measurement = "compute / comm. at " + f"{bandwidth:g} Mbit/s: " + "; ".join(
        f"{scheme} " + " → ".join(f"{ratio.loc[d, scheme]:.3g}" for d in sizes) for scheme in ratio.columns)
    measurement += f" (widths {', '.join(map(str, sizes))}; median of {int(data['repeats'].iloc[0])} timings)" \
        if "repeats" in data else f" (widths {', '.join(map(str, sizes))})"
    statistic = "; ".join(f"{scheme}: {s}" for scheme, (_, s) in results.items())
    first = data.iloc[0]
    link = f", {first['link']} link (docs/swarm.md)" if "link" in data else ""
    setup = (f"one crammed-BERT layer, microbatch {int(first['batch'])} x {int(first['seq_len'])} tokens, "
             f"{int(first['threads'])} CPU thread(s){link}; every scheme must rise")
    return Outcome(verdict, measurement, statistic, setup)


def _compression_evaluate(manifest):
    data = _read_study(manifest, "compression_loss")
    steps = int(data["step"].max())
    tail = data[data["step"] > steps / 2]
    wide = tail.pivot_table(index="step", columns="config", values="loss")
    setup = (f"the swarm model split into {int(data['stages'].iloc[0])} stages, one process; {steps} steps, same "
             f"batches and masks per config; paired over the last half of the steps")
    if not {"none", "blockwise8"} <= set(wide.columns):
        return Outcome(INCONCLUSIVE, "needs configs none and blockwise8", "no comparison", setup)
    outcome = equivalent(wide["blockwise8"] - wide["none"], margin=LOSS_MARGIN_NATS, unit="nats",
                         what="paired steps")
    measurement = (f"mean loss none {wide['none'].mean():.3f}, blockwise8 {wide['blockwise8'].mean():.3f} nats; "
                   + outcome.measurement)
    return Outcome(outcome.verdict, measurement, outcome.statistic + " (steps are autocorrelated)", setup)


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
          _swarm_inputs, _swarm_loss_evaluate),
    Claim("S2", "SWARM", "SWARM-trained fine-tunes about as well as single-process training", "§4 (convergence)",
          "no number in our sources [unverified]", "fine-tuning results: swarm, crammed (main vocab)",
          f"TOST over fine-tuning seeds, margin ±{GLUE_MARGIN_POINTS:g} points, α = 0.05", _swarm_glue_inputs,
          _swarm_glue_evaluate),
    Claim("S3", "SWARM", "Throughput-weighted stochastic wiring beats uniform routing on heterogeneous peers",
          "§3.1 (stochastic wiring)", "up to ~2.3x expected [proposal]", "swarm_study/wiring_throughput.csv",
          f"weighted / uniform ≥ {WIRING_RATIO:g} in every transport", _study_csv("wiring_throughput"),
          _wiring_evaluate),
    Claim("S4", "SWARM", "The swarm keeps training through peer failures, faster than fixed pipeline chains",
          "§3.1, §4 (throughput under failures)", "no number in our sources [unverified]",
          "swarm_study/failures_timeline.csv", "paired t-test over windows (weighted − fixed) > 0, α = 0.05; no "
          "stalled window", _study_csv("failures_timeline"), _failures_evaluate),
    Claim("S5", "SWARM", "Adaptive rebalancing restores the throughput of a starved stage", "§3.2, §4.3",
          "T = 300 s: 95.8 % of optimum vs 82.7 % without [secondary]", "swarm_study/rebalancing_recovery.csv",
          "paired t-test over late windows (rebalanced − off) > 0, α = 0.05", _study_csv("rebalancing_recovery"),
          _rebalancing_evaluate),
    Claim("S6", "SWARM", "The compute / communication ratio rises with layer width (square-cube law)",
          "§3 'square-cube law', Figure 1 (right)", "768: 18 %, 4096: 32 %, 12288: 82 % of time computing [paper]",
          "swarm_study/square_cube.csv", "Spearman ρ(width, compute/comm) > 0 per scheme, α = 0.05",
          _study_csv("square_cube"), _square_cube_evaluate),
    Claim("S7", "SWARM", "8-bit compression of activations and gradients costs about nothing in loss",
          "§4.2 / Appendix (compression)", "perplexities not found [unverified]", "swarm_study/compression_loss.csv",
          f"TOST over paired steps, margin ±{LOSS_MARGIN_NATS:g} nats, α = 0.05", _study_csv("compression_loss"),
          _compression_evaluate),
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
