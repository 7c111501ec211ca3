"""Result loading, seed aggregation, table writing and figures, on small synthetic results."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from cramswarm.cli import main as cli_main
from cramswarm.glue.metrics import PAPER_AVERAGE_COLUMNS, SCORE_COLUMNS, paper_average
from cramswarm.glue_tasks import TASKS
from cramswarm.report.figures import _new_figure, _save, plot_glue_by_task, plot_loss_curves, plot_vocab_sweep
from cramswarm.report.tables import (
    DEFAULT_REFERENCE_MODEL,
    glue_table,
    glue_table_with_paper,
    latex_escape,
    load_results,
    paper_rows,
    to_latex,
    vocab_sweep_table,
    write_table,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Every metric of every task scores BASE + the seed's offset. Offsets 0, 10, 4 are deliberately not sorted
# by seed: the median over seeds is BASE + 4 (the mean would be BASE + 4.67).
BASE = 50.0
SEED_OFFSETS = {0: 0.0, 1: 10.0, 2: 4.0}


def write_result(folder, model, vocab, task, seed, value, **extra):
    spec = TASKS[task]
    record = {
        "model": model,
        "vocab": vocab,
        "task": task,
        "seed": seed,
        "scores": {split: dict.fromkeys(spec.metrics, value) for split in spec.eval_splits},
        "epochs": 3,
        "train_examples": 100,
        "wall_s": 1.0,
        **extra,
    }
    path = folder / f"{model}_{vocab}_{task}_{seed}.json"
    path.write_text(json.dumps(record))
    return path


def write_runs(folder, model, vocab, seeds=SEED_OFFSETS, skip=(), base=BASE):
    return [
        write_result(folder, model, vocab, task, seed, base + offset)
        for task in TASKS
        if task not in skip
        for seed, offset in seeds.items()
    ]


@pytest.fixture
def results(tmp_path):
    """crammed/2048 complete with 3 seeds; scratch/2048 with 3 seeds but no RTE results."""
    folder = tmp_path / "results"
    folder.mkdir()
    paths = write_runs(folder, "crammed", 2048) + write_runs(folder, "scratch", 2048, skip=("rte",), base=30.0)
    return load_results(paths)


def test_load_results_long_form(results):
    assert list(results.columns) == ["model", "vocab", "task", "seed", "protocol", "column", "value"]
    crammed = results[results["model"] == "crammed"]
    # 13 score columns per seed (MNLI gives two rows, MRPC/QQP/STS-B two metrics each).
    assert len(crammed) == len(SCORE_COLUMNS) * len(SEED_OFFSETS)
    row = crammed[(crammed["column"] == "mnli_mm") & (crammed["seed"] == 1)]
    assert row["value"].tolist() == [BASE + 10.0]


def test_load_results_errors_name_the_file(tmp_path):
    good = write_result(tmp_path, "m", 2048, "cola", 0, 10.0)
    with pytest.raises(FileNotFoundError, match="absent.json"):
        load_results([good, tmp_path / "absent.json"])
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"model": "m", "vocab": ')
    with pytest.raises(ValueError, match="corrupt.json"):
        load_results([corrupt])
    no_scores = tmp_path / "no_scores.json"
    no_scores.write_text(json.dumps({"model": "m", "vocab": 2048, "task": "cola", "seed": 0}))
    with pytest.raises(ValueError, match="no_scores.json.*scores"):
        load_results([no_scores])
    wrong_metric = tmp_path / "wrong_metric.json"
    wrong_metric.write_text(
        json.dumps({"model": "m", "vocab": 2048, "task": "cola", "seed": 0, "scores": {"validation": {"f1": 1.0}}})
    )
    with pytest.raises(ValueError, match="wrong_metric.json"):
        load_results([wrong_metric])
    copy = tmp_path / "copy.json"
    copy.write_text(good.read_text())
    with pytest.raises(ValueError, match="copy.json.*duplicates"):
        load_results([good, copy])


def test_glue_table_medians_over_three_seeds(results):
    table = glue_table(results)
    expected = [
        "model",
        "vocab",
        "protocol",
        *SCORE_COLUMNS,
        "avg_paper",
        "avg_paper_seeds",
        "avg_paper_std",
        "avg_glue",
        "n_seeds",
    ]
    assert list(table.columns) == expected
    assert list(table.columns[3:13]) == [
        "mnli_m",
        "mnli_mm",
        "qqp_f1",
        "qqp_acc",
        "qnli",
        "sst2",
        "cola",
        "stsb_pearson",
        "stsb_spearman",
        "mrpc_f1",
    ]
    crammed = table.set_index("model").loc["crammed"]
    for column in SCORE_COLUMNS:
        assert crammed[column] == pytest.approx(54.0)  # median of 50, 60, 54
    # Per-seed paper averages are 50, 60, 54: median 54; sample std sqrt(((−14/3)² + (16/3)² + (−2/3)²) / 2)
    # = sqrt(76/3) ≈ 5.033.
    assert crammed["avg_paper"] == pytest.approx(54.0)
    assert crammed["avg_paper_seeds"] == pytest.approx(54.0)
    assert crammed["avg_paper_std"] == pytest.approx(math.sqrt(76 / 3))
    assert crammed["avg_glue"] == pytest.approx(54.0)
    assert crammed["n_seeds"] == 3


def test_glue_table_median_differs_from_mean_per_column(tmp_path):
    # CoLA over seeds 30, 50, 35 -> median 35 (mean 38.3); every other task constant at 70.
    cola = {0: 30.0, 1: 50.0, 2: 35.0}
    paths = write_runs(tmp_path, "m", 1024, skip=("cola",), base=70.0, seeds=dict.fromkeys(cola, 0.0))
    paths += [write_result(tmp_path, "m", 1024, "cola", seed, value) for seed, value in cola.items()]
    row = glue_table(load_results(paths)).iloc[0]
    assert row["cola"] == pytest.approx(35.0)
    # Per-seed paper averages (8*70 + cola)/9: median of those is (560 + 35)/9.
    assert row["avg_paper"] == pytest.approx(595 / 9)


def test_paper_average_is_mean_of_task_medians_not_median_of_seed_means(tmp_path):
    # CoLA 30, 50, 35 and SST-2 40, 60, 70 over seeds 0-2, every other task 70. Task medians: CoLA 35, SST-2 60,
    # so the paper's average (mean of the printed medians) is (7*70 + 95)/9. Per-seed sums of the two tasks are
    # 70, 110, 105: the median of per-seed averages is (7*70 + 105)/9 instead.
    varying = {"cola": {0: 30.0, 1: 50.0, 2: 35.0}, "sst2": {0: 40.0, 1: 60.0, 2: 70.0}}
    paths = write_runs(tmp_path, "m", 1024, skip=tuple(varying), base=70.0, seeds=dict.fromkeys(range(3), 0.0))
    paths += [
        write_result(tmp_path, "m", 1024, task, seed, value)
        for task, values in varying.items()
        for seed, value in values.items()
    ]
    row = glue_table(load_results(paths)).iloc[0]
    assert row["avg_paper"] == pytest.approx((7 * 70 + 95) / 9)
    assert row["avg_paper_seeds"] == pytest.approx((7 * 70 + 105) / 9)
    assert row["avg_paper"] == pytest.approx(paper_average(row))


def test_missing_task_gives_nan_not_a_shorter_average(results):
    scratch = glue_table(results).set_index("model").loc["scratch"]
    assert math.isnan(scratch["rte"])
    assert math.isnan(scratch["avg_paper"]) and math.isnan(scratch["avg_glue"])
    assert scratch["cola"] == pytest.approx(34.0)


def test_average_matches_paper_rule_per_seed(results):
    row = glue_table(results).iloc[0]
    assert row["avg_paper"] == pytest.approx(paper_average(row))


def test_write_table_csv_and_markdown(results, tmp_path):
    table = glue_table(results)
    csv_path, md_path = write_table(table, tmp_path / "out" / "glue")
    assert (csv_path.name, md_path.name) == ("glue.csv", "glue.md")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["glue.csv", "glue.md"]  # no temp leftovers

    back = pd.read_csv(csv_path)
    assert list(back.columns) == list(table.columns)
    assert back.loc[back["model"] == "crammed", "avg_paper_std"].item() == pytest.approx(math.sqrt(76 / 3))
    assert math.isnan(back.loc[back["model"] == "scratch", "rte"].item())

    lines = md_path.read_text().splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header[:5] == ["Model", "Vocab", "Protocol", "MNLI-m", "MNLI-mm"]
    assert "GLUE avg (paper)" in header and "Seeds" in header
    crammed = [cell.strip() for cell in next(line for line in lines if "crammed" in line).strip("|").split("|")]
    assert crammed[:4] == ["crammed", "2048", "", "54.0"]  # these results record no protocol
    assert crammed[header.index("± seed std")] == "5.0"
    assert crammed[header.index("Seeds")] == "3"
    scratch = [cell.strip() for cell in next(line for line in lines if "scratch" in line).strip("|").split("|")]
    assert scratch[header.index("RTE")] == "NaN"


def test_glue_table_names_the_protocols_the_results_record(tmp_path):
    paths = [write_result(tmp_path, "a", 64, task, 0, 50.0, protocol={"name": "crammed", "lr": 1e-4}) for task in TASKS]
    paths += [write_result(tmp_path, "b", 64, task, 0, 50.0, protocol={"name": "bert_checkpoint"}) for task in TASKS]
    paths.append(write_result(tmp_path, "b", 64, "cola", 1, 50.0, protocol={"name": "crammed"}))
    table = glue_table(load_results(paths)).set_index("model")
    assert table.loc["a", "protocol"] == "crammed"
    assert table.loc["b", "protocol"] == "bert_checkpoint/crammed"  # a mixed row says so


def test_vocab_sweep_table(tmp_path):
    paths = []
    for vocab, base in ((8192, 60.0), (512, 40.0), (2048, 55.0)):
        paths += write_runs(tmp_path, "crammed", vocab, base=base)
    paths += write_runs(tmp_path, "scratch", 2048, base=30.0)
    sweep = vocab_sweep_table(load_results(paths), exclude=["scratch"])
    assert list(sweep.columns) == [
        "model",
        "vocab",
        "avg_paper",
        "avg_paper_seeds",
        "avg_paper_std",
        "mnli_m",
        "mnli_m_std",
        "n_seeds",
    ]
    assert sweep["vocab"].tolist() == [512, 2048, 8192]
    assert sweep["avg_paper"].tolist() == pytest.approx([44.0, 59.0, 64.0])
    assert sweep["mnli_m_std"].tolist() == pytest.approx([math.sqrt(76 / 3)] * 3)


def assert_png(path) -> str:
    """The figure exists as PNG and PDF with a caption beside it (and nothing else: temp files were renamed);
    returns the caption."""
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)
    assert path.with_suffix(".pdf").read_bytes().startswith(b"%PDF")
    stem = path.name.removesuffix(".png")
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        f"{stem}{ext}" for ext in (".caption.rst", ".pdf", ".png")
    )
    caption = path.with_suffix(".caption.rst").read_text()
    assert len(caption) > 100 and "{{" not in caption
    return caption


def test_plot_loss_curves(tmp_path):
    tokens = np.arange(1, 51) * 4096
    log = pd.DataFrame(
        {"step": np.arange(50), "tokens": tokens, "loss": 9.0 / np.log(tokens), "lr": 1e-3, "elapsed_s": 0.1}
    )
    csv = tmp_path / "v512.csv"
    log.assign(loss=log["loss"] + 0.5).to_csv(csv, index=False)
    out = plot_loss_curves({"vocab 2048": log, "vocab 512": csv}, tmp_path / "fig" / "loss.png", log_x=True)
    caption = assert_png(out)
    # the caption states each run's last loss and what the paper gives (no values for this plot)
    assert f"vocab 512 {log['loss'].iloc[-1] + 0.5:.3f} at 204,800 tokens" in caption and "paper" in caption
    with pytest.raises(ValueError, match="tokens"):
        plot_loss_curves({"bad": log.drop(columns="tokens")}, tmp_path / "bad.png")


def test_plot_vocab_sweep(tmp_path):
    sweep = pd.DataFrame(
        {
            "model": "crammed",
            "vocab": [512, 2048, 8192],
            "avg_paper": [60.0, 66.0, 68.0],
            "avg_paper_std": [1.0, float("nan"), 0.5],  # NaN: a single-seed point without an error bar
            "mnli_m": [62.0, 68.0, 70.0],
            "mnli_m_std": [0.8, 1.2, 0.4],
            "n_seeds": [3, 1, 3],
        }
    )
    baseline = pd.Series({"avg_paper": 45.0, "mnli_m": 55.0})
    caption = assert_png(plot_vocab_sweep(sweep, tmp_path / "fig" / "sweep.png", baseline=baseline))
    assert "crammed 68.0 at 8192" in caption and "[paper]" in caption


def test_plot_glue_by_task(results, tmp_path):
    caption = assert_png(plot_glue_by_task(results, tmp_path / "fig" / "tasks.png"))
    assert "paper: crammed BERT, 24 h (v1 Table 3)" in caption  # the published per-task values are drawn
    assert "synthetic stand-in" in caption
    hub = assert_png(plot_glue_by_task(results, tmp_path / "hub" / "tasks.png", source="hub"))
    assert "synthetic" not in hub


def test_figure_needs_png_path_and_caption(tmp_path):
    fig = _new_figure(2, 2)
    with pytest.raises(ValueError, match="must end in .png"):
        _save(fig, tmp_path / "x.jpg", "a caption")
    with pytest.raises(ValueError, match="empty caption"):
        _save(fig, tmp_path / "x.png", "  ")
    with pytest.raises(ValueError, match="Jinja"):
        _save(fig, tmp_path / "x.png", "a {{ template }}")
    assert not list(tmp_path.iterdir())


# --- published rows beside ours -------------------------------------------------------------------------------


def test_paper_rows_transcription_matches_published_average():
    rows = paper_rows()
    assert list(rows.columns) == ["source", "model", *PAPER_AVERAGE_COLUMNS, "avg_paper", "note"]
    assert DEFAULT_REFERENCE_MODEL in set(rows["model"])
    assert rows["note"].str.match(r"\[(paper|third-party|derived)\]").all()
    assert rows["source"].str.len().gt(0).all() and rows["avg_paper"].notna().all()
    complete = rows.dropna(subset=list(PAPER_AVERAGE_COLUMNS))
    assert len(complete) >= 5  # v1: BERT-base, no-pretrain, RoBERTa-base, crammed A6000; ICML HF card
    for _, row in complete.iterrows():
        # The paper's rule: mean of the nine (MNLI-m and -mm separately, QQP/MRPC F1, STS-B Pearson, no WNLI).
        assert paper_average(row) == pytest.approx(row["avg_paper"], abs=0.1), row["model"]
    crammed = rows.set_index("model").loc[DEFAULT_REFERENCE_MODEL]
    assert (crammed["mnli_m"], crammed["cola"], crammed["avg_paper"]) == (83.9, 44.5, 78.6)


def ours_frame():
    scores = dict.fromkeys(SCORE_COLUMNS, 80.0)
    return pd.DataFrame(
        [
            {
                "model": "crammed",
                "vocab": 2048,
                **scores,
                "avg_paper": 80.0,
                "avg_paper_std": 0.5,
                "avg_glue": 80.0,
                "n_seeds": 3,
            },
            {
                "model": "scratch",
                "vocab": 2048,
                **scores,
                "avg_paper": float("nan"),
                "avg_paper_std": float("nan"),
                "avg_glue": float("nan"),
                "n_seeds": 1,
            },
        ]
    )


def paper_frame():
    return pd.DataFrame(
        {
            "source": ["S1", "S2"],
            "model": ["ref_a", "ref_b"],
            **{c: [70.0, float("nan")] for c in PAPER_AVERAGE_COLUMNS},
            "avg_paper": [78.6, 75.0],
            "note": ["[paper]", "[third-party]"],
        }
    )


def test_glue_table_with_paper_delta():
    ours = ours_frame()
    table = glue_table_with_paper(ours, "ref_a", paper=paper_frame())
    assert table["kind"].tolist() == ["ours", "ours", "published", "published"]
    assert table["model"].tolist() == ["crammed", "scratch", "ref_a", "ref_b"]
    columns = list(table.columns)
    assert columns[0] == "kind" and columns[-2:] == ["source", "note"]
    assert columns.index("avg_paper_delta") == columns.index("avg_paper") + 1
    assert table.loc[0, "avg_paper_delta"] == pytest.approx(80.0 - 78.6)
    assert table["avg_paper_delta"][1:].isna().all()  # no average for scratch; none for the published rows
    assert table.loc[2, "avg_paper"] == 78.6 and table.loc[3, "note"] == "[third-party]"
    assert str(table["vocab"].dtype) == "Int64" and table["vocab"].tolist()[:2] == [2048, 2048]
    assert table["vocab"][2:].isna().all()
    pd.testing.assert_frame_equal(ours, ours_frame())  # the input is not modified
    other = glue_table_with_paper(ours, "ref_b", paper=paper_frame())
    assert other.loc[0, "avg_paper_delta"] == pytest.approx(5.0)
    with pytest.raises(ValueError, match="unknown reference model 'nope'"):
        glue_table_with_paper(ours, "nope", paper=paper_frame())
    # Default: the shipped rows, delta against the v1 crammed A6000 row (78.6).
    default = glue_table_with_paper(ours)
    assert default.loc[0, "avg_paper_delta"] == pytest.approx(80.0 - 78.6)
    assert (default["kind"] == "published").sum() == len(paper_rows())


def test_latex_escaping_and_nan():
    assert latex_escape("a_b 5% R&D #1") == r"a\_b 5\% R\&D \#1"
    df = pd.DataFrame(
        {
            "kind": ["ours", "published"],
            "model": ["crammed_v1", "BERT & co"],
            "vocab": pd.array([2048, None], "Int64"),
            "cola": [44.46, float("nan")],
            "avg_paper_delta": [-2.34, float("nan")],
        }
    )
    tex = to_latex(df)
    lines = tex.splitlines()
    assert lines[0] == r"\begin{tabular}{llrrr}" and lines[1] == r"\toprule" and lines[-1] == r"\end{tabular}"
    assert lines[2] == r"Kind & Model & Vocab & CoLA & $\Delta$ avg vs paper crammed \\"
    assert r"ours & crammed\_v1 & 2048 & 44.5 & -2.3 \\" in lines
    assert r"published & BERT \& co & -- & -- & -- \\" in lines
    # a rule separates our rows from the published ones
    assert lines.index(r"published & BERT \& co & -- & -- & -- \\") - 1 == lines.index(r"\midrule", 4)
    assert "nan" not in tex.lower() and "<NA>" not in tex


def test_write_table_latex_option(tmp_path):
    df = pd.DataFrame({"model": ["m_1"], "cola": [float("nan")]})
    assert [p.name for p in write_table(df, tmp_path / "t")] == ["t.csv", "t.md"]
    paths = write_table(df, tmp_path / "u", latex=True)
    assert [p.name for p in paths] == ["u.csv", "u.md", "u.tex"]
    assert r"m\_1 & -- \\" in paths[2].read_text()


def test_cli_tables_writes_paper_files(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    paths = write_runs(folder, "crammed", 2048, base=80.0) + write_runs(folder, "scratch", 2048, base=30.0)
    summary = tmp_path / "summary.json"  # crammed's pretraining read its blocks 1.5 times; scratch is random init
    summary.write_text(json.dumps({"run": "crammed", "tokens": 3_000_000, "epochs_of_data": 1.5}))
    out = tmp_path / "tables"
    argv = [
        "tables",
        "--results",
        *map(str, paths),
        "--out-stem",
        str(out / "glue"),
        "--pretraining",
        json.dumps([["crammed", 2048, str(summary)]]),
    ]
    assert cli_main(argv) == 0
    # exactly these files: no temporary leftovers
    assert sorted(p.name for p in out.iterdir()) == ["glue.csv", "glue.md", "glue_paper.csv", "glue_paper.md",
                                                      "glue_paper.tex"]
    sweep_argv = ["vocab-sweep", "--results", *map(str, paths), "--baseline", "scratch", "--out-stem",
                  str(out / "sweep" / "vocab_sweep"), "--png", str(out / "sweep" / "glue_vs_vocab.png")]
    assert cli_main(sweep_argv) == 0
    assert sorted(p.name for p in (out / "sweep").iterdir()) == [
        "glue_vs_vocab.caption.rst", "glue_vs_vocab.pdf", "glue_vs_vocab.png", "vocab_sweep.csv", "vocab_sweep.md"]
    assert pd.read_csv(out / "sweep" / "vocab_sweep.csv")["model"].tolist() == ["crammed"]  # the baseline left out

    paper = pd.read_csv(out / "glue_paper.csv")
    assert paper["kind"].tolist() == ["ours"] * 2 + ["published"] * len(paper_rows())
    crammed = paper.set_index("model").loc["crammed"]
    assert crammed["avg_paper"] == pytest.approx(84.0)  # 80 + median seed offset 4
    assert crammed["avg_paper_delta"] == pytest.approx(84.0 - 78.6)
    # what each model's pretraining saw, beside the delta: tokens and passes over the data (> 1: it wrapped)
    columns = paper.columns.tolist()
    assert columns[columns.index("avg_paper_delta") + 1 : columns.index("avg_paper_delta") + 3] == [
        "pretrain_tokens", "data_passes"]
    assert (crammed["pretrain_tokens"], crammed["data_passes"]) == (3_000_000, 1.5)
    assert paper.set_index("model").loc["scratch", ["pretrain_tokens", "data_passes"]].isna().all()
    assert "Passes over the data" in (out / "glue_paper.md").read_text()
    assert pd.read_csv(out / "glue.csv").columns.tolist()[0] == "model"
    md = (out / "glue_paper.md").read_text()
    assert "Δ avg vs paper crammed" in md and DEFAULT_REFERENCE_MODEL in md
    header = [cell.strip() for cell in md.splitlines()[0].strip("|").split("|")]
    crammed_line = next(line for line in md.splitlines() if "| crammed" in line)
    crammed_md = [cell.strip() for cell in crammed_line.strip("|").split("|")]
    assert crammed_md[header.index("Source")] == ""  # text our rows lack is blank, not "NaN"
    assert "NaN" not in crammed_md
    tex = (out / "glue_paper.tex").read_text()
    assert tex.startswith(r"\begin{tabular}") and r"Crammed BERT (A6000, 24 h, v1)" in tex and "5.4" in tex

    # another reference row
    assert cli_main([*argv, "--paper-reference", "RoBERTa-base"]) == 0
    paper = pd.read_csv(out / "glue_paper.csv").set_index("model")
    assert paper.loc["crammed", "avg_paper_delta"] == pytest.approx(84.0 - 85.1)
    assert cli_main([*argv, "--paper-reference", "no such row"]) == 2
