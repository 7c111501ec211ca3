"""What the claims check is made of (:mod:`cramswarm.report.claims`): the verdicts, a claim and its outcome, the
statistical tests and the readers of the result files a manifest names."""

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
from cramswarm.report.tables import load_results, per_seed_scores

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


def signed(value: float, digits: int = 2) -> str:
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
    measurement = f"Δ = {signed(d.mean(), mean_digits)} {unit} (mean ± sd {spread} over {n} {what})"
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
        return Outcome(verdict, measurement, f"all {n} differences equal ({signed(d[0])}); margin {margin:g}")
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
        return Outcome(verdict, measurement, f"all {n} differences equal ({signed(d[0], 3)}); margin ±{margin:g}")
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


def read_summary(folder: str | os.PathLike) -> dict:
    return read_json_object(Path(folder) / "summary.json", "pretraining summary", missing=ValueError)


def loss_noise(folder: str | os.PathLike) -> float:
    """Standard deviation (ddof=1) of the logged training loss over the last :data:`TAIL_SHARE` of a run's rows."""
    log = pd.read_csv(Path(folder) / "train_log.csv")
    loss = pd.to_numeric(log["loss"], errors="coerce").dropna()
    tail = loss.iloc[-max(2, math.ceil(TAIL_SHARE * len(loss))):]
    return float(tail.std(ddof=1)) if len(tail) > 1 else math.nan


def eval_loss_of(summary: dict) -> float:
    value = summary.get("eval_loss")
    return math.nan if value is None else float(value)


def shape_label(summary: dict) -> str:
    arch = summary.get("arch", {})
    params = summary.get("parameters")
    size = f", {params / 1e6:.3g} M params" if params else ""
    return f"{arch.get('layers', '?')}x{arch.get('hidden_size', '?')}{size}"


def tokens_label(summary: dict) -> str:
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


def common_columns(frames: Iterable[pd.DataFrame]) -> list[str]:
    common = None
    for frame in frames:
        have = {c for c in PAPER_AVERAGE_COLUMNS if c in frame.columns and frame[c].notna().all()}
        common = have if common is None else common & have
    return [c for c in PAPER_AVERAGE_COLUMNS if c in (common or set())]


def role_model(manifest: Mapping, role: str) -> str:
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


def glue_paths(manifest: Mapping, model: str, vocab: int | None = None) -> list[str]:
    vocab = manifest["main_vocab"] if vocab is None else vocab
    if int(vocab) not in [int(v) for v in manifest.get("glue", {}).get(model, [])]:
        raise MissingInput(f"the study fine-tunes no {model} at vocab {vocab}")
    return finetune_paths(manifest, model, vocab)


def checkpoint_folder(manifest: Mapping, model: str, vocab: int | None = None) -> str:
    vocab = manifest["main_vocab"] if vocab is None else vocab
    folder = manifest.get("checkpoints", {}).get(model, {}).get(str(vocab))
    if not folder:
        raise MissingInput(f"no checkpoint of {model} at vocab {vocab} in the manifest")
    return folder


def run_files(folder: str) -> list[str]:
    return [f"{folder}/summary.json", f"{folder}/train_log.csv"]


def glue_setup(manifest: Mapping, seeds: pd.DataFrame, models: Iterable[str]) -> str:
    n_seeds = seeds["seed"].nunique()
    n_cols = int(seeds["n_columns"].iloc[0]) if len(seeds) else 0
    return (f"{manifest['source']}; vocab {manifest['main_vocab']}; {', '.join(models)}; "
            f"{n_seeds} fine-tuning seeds; GLUE avg over {n_cols} paper column(s)")
