"""The papers' claims, checked (cramswarm.report.claims): verdicts from fixture result files, the table, the CLI
and what the `claims` target plans."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import TINY, copy_workflow, planned_jobs

from cramswarm.glue_tasks import TASKS
from cramswarm.report import claim_tests
from cramswarm.report import claims as c

TASK_NAMES = ("sst2", "mnli", "stsb")
SEEDS = (0, 1, 2, 3, 4)
NOISE = (0.0, 1.5, -1.0, 0.5, 2.0)  # per-seed offsets shared by every model: paired differences cancel them
ARCH = {"layers": 2, "hidden_size": 64, "heads": 2}


def write_glue(root, model, vocab, base, jitter=(0.3, -0.2, 0.1, -0.1, 0.2), seeds=SEEDS, tasks=TASK_NAMES):
    """Fine-tuning results of one (model, vocab): every metric scores base + NOISE[seed] + jitter[seed]."""
    paths = []
    for task in tasks:
        spec = TASKS[task]
        for seed in seeds:
            value = base + NOISE[seed] + jitter[seed]
            path = root / "glue" / model / f"v{vocab}" / task / f"s{seed}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            record = {"model": model, "vocab": vocab, "task": task, "seed": seed,
                      "scores": {split: dict.fromkeys(spec.metrics, value) for split in spec.eval_splits}}
            path.write_text(json.dumps(record))
            paths.append(str(path))
    return paths


def write_run(folder, run, eval_loss, *, parameters=100_000, arch=ARCH, recipe=None, noise=0.01, swarm=None):
    """summary.json and train_log.csv of a pretraining run; the log's last rows scatter by about ``noise``."""
    folder.mkdir(parents=True, exist_ok=True)
    summary = {"run": run, "tokens": 16384, "parameters": parameters, "eval_loss": eval_loss, "arch": arch,
               "recipe": recipe or {"schedule": "triangle", "lr": 1e-3}}
    if swarm:
        summary["swarm"] = swarm
    (folder / "summary.json").write_text(json.dumps(summary))
    steps = np.arange(1, 41)
    wiggle = noise * np.where(steps % 2 == 0, 1.0, -1.0)
    loss = eval_loss + 1.0 / steps + wiggle
    pd.DataFrame({"step": steps, "tokens": steps * 512, "loss": loss}).to_csv(folder / "train_log.csv", index=False)
    return str(folder)


def write_swarm_study(root):
    out = root / "swarm_study"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pd.DataFrame(
        [{"transport": t, "routing": r, "stages": 2, "peers": 6, "trainers": 8, "throughput_mb_s": v,
          "optimum_mb_s": 3.5, "percent_of_optimum": 100 * v / 3.5, "duration_s": 40.0}
         for t in ("emulation", "simulator") for r, v in (("weighted", 3.0), ("uniform", 1.5), ("fixed", 1.0))]
    ).to_csv(out / "wiring_throughput.csv", index=False)
    rows = []
    for t in ("emulation", "simulator"):
        for routing, level in (("weighted", 2.0), ("fixed", 1.0)):
            for failures in ("none", "periodic"):
                for start in range(0, 100, 10):
                    rows.append({"transport": t, "routing": routing, "failures": failures, "t_s": float(start),
                                 "window_s": 10.0, "throughput_mb_s": level + rng.normal(0, 0.1), "peers_up": 8.0,
                                 "retries": 3, "lost_microbatches": 0})
    pd.DataFrame(rows).to_csv(out / "failures_timeline.csv", index=False)
    rows = []
    for t in ("emulation", "simulator"):
        for period in (np.nan, 10.0):
            for start in range(0, 100, 10):
                after = start >= 20
                level = 2.0 if not after else (1.0 if np.isnan(period) else 1.9)
                rows.append({"transport": t, "rebalance_period_s": period, "kill_at_s": 20.0, "t_s": float(start),
                             "window_s": 10.0, "throughput_mb_s": level + rng.normal(0, 0.05), "peers_up": 9.0,
                             "moves": 0 if np.isnan(period) else 2, "first_move_s": np.nan if np.isnan(period) else 30})
    pd.DataFrame(rows).to_csv(out / "rebalancing_recovery.csv", index=False)
    pd.DataFrame(
        [{"hidden_size": d, "heads": 1, "batch": 2, "seq_len": 16, "threads": 1, "layer_params": d * d,
          "compute_s": 1e-6 * d * d, "scheme": s, "activation_payload_bytes": d * (4 if s == "none" else 1),
          "bandwidth_mbit_s": 100.0, "comm_s": 1e-5 * d, "compute_to_comm": 0.1 * d * (1 if s == "none" else 4)}
         for d in (64, 128, 256, 512) for s in ("none", "blockwise8")]
    ).to_csv(out / "square_cube.csv", index=False)
    rows = []
    for step in range(1, 41):
        base = 5.0 - 0.05 * step + rng.normal(0, 0.05)
        for config, shift in (("none", 0.0), ("blockwise8", 0.002), ("maxout2", 0.3)):
            rows.append({"config": config, "stages": 2, "step": step, "tokens": step * 128,
                         "loss": base + shift + rng.normal(0, 0.003)})
    pd.DataFrame(rows).to_csv(out / "compression_loss.csv", index=False)
    return {name: str(out / f"{name}.csv") for name in
            ("square_cube", "wiring_throughput", "failures_timeline", "rebalancing_recovery", "compression_loss")}


@pytest.fixture
def manifest(tmp_path):
    """Result files on which every claim holds."""
    for vocab, base in ((512, 60.0), (1024, 65.0), (2048, 70.0)):
        write_glue(tmp_path, "crammed", vocab, base)
    write_glue(tmp_path, "bert_original", 2048, 60.0)
    write_glue(tmp_path, "izsak", 2048, 62.0)
    write_glue(tmp_path, "no_pretrain", 2048, 40.0)
    write_glue(tmp_path, "swarm", 2048, 70.0, jitter=(0.25, -0.15, 0.15, -0.05, 0.2))
    glue = {"crammed": [512, 1024, 2048], **{m: [2048] for m in ("bert_original", "izsak", "no_pretrain", "swarm")}}
    ckpt = tmp_path / "pretrain"
    swarm_settings = {"stages": 2, "peers_per_stage": 2, "compression": "blockwise8"}
    checkpoints = {
        "crammed": {"2048": write_run(ckpt / "crammed", "crammed", 3.0)},
        "bert_original": {"2048": write_run(ckpt / "bert_original", "bert_original", 3.5)},
        "izsak": {"2048": write_run(ckpt / "izsak", "izsak", 3.3)},
        "swarm": {"2048": write_run(ckpt / "swarm", "swarm", 3.02, swarm=swarm_settings)},
    }
    arch = {f"v{i}": write_run(ckpt / f"arch-{i}", f"arch-{i}", 4.0 - 0.2 * i, parameters=100_000 * (i + 1))
            for i in range(5)}
    schedule = {}
    for name, offset in (("triangle", 0.0), ("one-cycle", 0.05), ("constant", 0.5), ("inverse-sqrt", 0.4)):
        for lr in (1e-3, 4e-3):
            schedule[f"{name} @ {lr:g}"] = write_run(ckpt / f"sched-{name}-{lr:g}", f"sched-{name}-{lr:g}",
                                                     3.0 + offset + (0.1 if lr > 2e-3 else 0.0),
                                                     recipe={"schedule": name, "lr": lr})
    data = {}
    for source in ("synthetic", "noisy"):
        for cell, base in (("none", 50.0), ("filtered", 54.0), ("filtered_sorted", 57.0)):
            run = f"data-{source}-{cell}"
            data[run] = {"source": source, "cell": cell}
            write_glue(tmp_path, run, 2048, base + (1.0 if source == "noisy" else 0.0), tasks=("sst2",))
    return {"source": "synthetic", "main_vocab": 2048,
            "roles": {r: r for r in ("crammed", "bert_original", "izsak", "no_pretrain", "swarm")},
            "finetune": {"pattern": str(tmp_path / "glue" / "{model}" / "v{vocab}" / "{task}" / "s{seed}.json"),
                         "tasks": list(TASK_NAMES), "seeds": list(SEEDS), "ablation_tasks": ["sst2"]},
            "glue": glue, "checkpoints": checkpoints, "arch": arch, "schedule": schedule, "data": data,
            "swarm_study": write_swarm_study(tmp_path)}


def by_id(manifest):
    return {claim.id: c.check(claim, manifest) for claim in c.CLAIMS}


def test_every_claim_holds_on_results_that_support_it(manifest):
    outcomes = by_id(manifest)
    assert {cid: o.verdict for cid, o in outcomes.items() if o.verdict != c.HOLDS} == {}
    for outcome in outcomes.values():
        assert outcome.measurement and outcome.statistic and outcome.setup


def test_claim_ids_are_unique_and_cover_both_papers():
    ids = [claim.id for claim in c.CLAIMS]
    assert len(ids) == len(set(ids)) >= 17
    assert {claim.paper for claim in c.CLAIMS} == {"Cramming", "SWARM"}


def test_glue_claims_measure_the_paired_gap_with_its_seed_spread(manifest):
    outcome = by_id(manifest)["C2"]
    # crammed 70 vs bert_original 60 with the same per-seed noise and jitter: Δ = 10.0 exactly, sd 0
    assert "Δ = +10.00 points" in outcome.measurement and "over 5 paired fine-tuning seeds" in outcome.measurement
    assert "5 fine-tuning seeds" in outcome.setup


def test_a_reversed_gap_does_not_hold(manifest, tmp_path):
    write_glue(tmp_path, "bert_original", 2048, 75.0, jitter=(0.1, 0.4, -0.3, 0.0, 0.2))
    manifest["checkpoints"]["bert_original"]["2048"] = write_run(tmp_path / "b" / "ckpt", "bert_original", 2.5)
    outcomes = by_id(manifest)
    assert outcomes["C1"].verdict == c.FAILS  # lower loss for BERT's recipe, by 0.5 nats against 0.01 noise
    assert outcomes["C2"].verdict == c.FAILS
    assert "p(Δ < margin)" in outcomes["C2"].statistic


def test_pretraining_gap_below_the_claimed_margin_does_not_hold(manifest, tmp_path):
    write_glue(tmp_path, "no_pretrain", 2048, 68.0, jitter=(0.1, -0.1, 0.0, 0.1, -0.1))
    assert by_id(manifest)["C5"].verdict == c.FAILS  # Δ ≈ 2 points, significantly below the 5-point margin


def test_two_seeds_are_inconclusive(manifest):
    manifest["finetune"]["seeds"] = [0, 1]
    outcome = by_id(manifest)["C2"]
    assert outcome.verdict == c.INCONCLUSIVE and "fewer than 3" in outcome.statistic


def test_loss_difference_within_noise_is_inconclusive(manifest, tmp_path):
    manifest["checkpoints"]["bert_original"]["2048"] = write_run(tmp_path / "noisy", "bert_original", 3.05, noise=0.2)
    outcome = by_id(manifest)["C1"]
    assert outcome.verdict == c.INCONCLUSIVE and "noise" in outcome.statistic


def test_absent_inputs_are_not_run(manifest):
    Path(manifest["swarm_study"]["wiring_throughput"]).unlink()
    del manifest["roles"]["izsak"]
    outcomes = by_id(manifest)
    assert outcomes["S3"].verdict == c.NOT_RUN and "absent" in outcomes["S3"].measurement
    assert outcomes["C3"].verdict == outcomes["C4"].verdict == c.NOT_RUN
    assert "no izsak model" in outcomes["C4"].measurement
    assert outcomes["C1"].verdict == c.HOLDS  # the others still read their files


def test_empty_manifest_marks_every_claim_not_run():
    table = c.claims_table({"source": "synthetic", "main_vocab": 2048})
    assert (table["verdict"] == c.NOT_RUN).all()


def test_trends_need_enough_levels_and_fail_when_reversed(manifest):
    manifest["glue"]["crammed"] = [1024, 2048]
    assert by_id(manifest)["C8"].verdict == c.INCONCLUSIVE  # two vocab sizes
    verdict, _ = c.trend([1, 2, 3, 4, 5], [5, 4, 3, 2, 1], increasing=True)
    assert verdict == c.FAILS
    verdict, _ = c.trend([1, 2, 3, 4, 5], [1, 3, 2, 5, 4], increasing=True)
    assert verdict == c.INCONCLUSIVE  # ρ = 0.8 over 5 points: one-sided p ≈ 0.07


def test_swarm_claims_read_the_study_csvs(manifest):
    square = pd.read_csv(manifest["swarm_study"]["square_cube"])
    square["compute_to_comm"] = 1.0 / square["hidden_size"]  # falling with width
    square.to_csv(manifest["swarm_study"]["square_cube"], index=False)
    compression = pd.read_csv(manifest["swarm_study"]["compression_loss"])
    compression.loc[compression["config"] == "blockwise8", "loss"] += 0.5
    compression.to_csv(manifest["swarm_study"]["compression_loss"], index=False)
    outcomes = by_id(manifest)
    assert outcomes["S6"].verdict == c.FAILS
    assert outcomes["S7"].verdict == c.FAILS and "+0.5" in outcomes["S7"].measurement


def test_a_stalled_swarm_does_not_survive_failures(manifest):
    path = manifest["swarm_study"]["failures_timeline"]
    data = pd.read_csv(path)
    stalled = (data["routing"] == "weighted") & (data["failures"] == "periodic") & (data["t_s"] == 50.0)
    data.loc[stalled, "throughput_mb_s"] = 0.0
    data.to_csv(path, index=False)
    outcome = by_id(manifest)["S4"]
    assert outcome.verdict == c.FAILS and "at zero after the first: 2" in outcome.measurement


def test_testbed_rows_without_fixed_chains_are_named_as_left_out_of_the_pairs(manifest):
    path = manifest["swarm_study"]["failures_timeline"]
    data = pd.read_csv(path)
    testbed = data[(data["transport"] == "emulation") & (data["routing"] == "weighted")].assign(transport="testbed")
    pd.concat([data, testbed]).to_csv(path, index=False)
    outcome = by_id(manifest)["S4"]
    assert outcome.verdict == c.HOLDS
    assert "transports emulation, simulator;" in outcome.setup and "testbed left out: no fixed chains" in outcome.setup


def test_swarm_of_another_shape_is_not_compared(manifest, tmp_path):
    manifest["checkpoints"]["swarm"]["2048"] = write_run(tmp_path / "s", "swarm", 3.02,
                                                         arch={**ARCH, "layers": 4}, parameters=200_000)
    outcomes = by_id(manifest)
    assert outcomes["S1"].verdict == outcomes["S2"].verdict == c.INCONCLUSIVE
    assert "differ in shape" in outcomes["S1"].statistic


def test_equivalence_and_paired_tests():
    assert claim_tests.equivalent([0.01, -0.02, 0.0, 0.015, -0.01], margin=0.05).verdict == c.HOLDS
    assert claim_tests.equivalent([0.5, 0.6, 0.55, 0.52, 0.58], margin=0.05).verdict == c.FAILS
    assert claim_tests.equivalent([0.5, -0.4, 0.3, -0.6, 0.1], margin=0.05).verdict == c.INCONCLUSIVE
    assert c.paired_greater([1.0, 1.2, 0.9, 1.1]).verdict == c.HOLDS
    assert c.paired_greater([1.0, -1.2, 0.9, -1.1]).verdict == c.INCONCLUSIVE
    with pytest.raises(ValueError, match="unknown verdict"):
        c.Outcome("probably", "x")


def test_table_has_every_claim_and_csv_and_markdown_agree(manifest, tmp_path):
    csv_path, md_path = c.write_claims(manifest, tmp_path / "out" / "claims")
    table = pd.read_csv(csv_path, dtype=str, keep_default_na=False)
    assert list(table.columns) == list(c.COLUMNS)
    assert list(table["id"]) == [claim.id for claim in c.CLAIMS]
    assert set(table["verdict"]) <= set(c.VERDICTS)
    lines = md_path.read_text().splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == [c.LABELS[col] for col in c.COLUMNS]
    rows = [line for line in lines[2:] if line.startswith("|")]
    assert len(rows) == len(table)
    for line, (_, row) in zip(rows, table.iterrows()):
        cells = [cell.strip().replace("\\|", "|") for cell in line.strip().strip("|").split(" | ")]
        assert cells == [row[col].strip() for col in c.COLUMNS]
    assert f"holds {len(c.CLAIMS)}" in lines[-1]
    assert not list((tmp_path / "out").glob(".*"))  # atomic writes leave no temporary file


def test_cli_writes_the_table_and_its_readme_copy_with_where_its_inputs_were_made(manifest, tmp_path):
    from cramswarm.report import docs

    # two of the inputs record their provenance (as fine-tuning results do), made on different machines
    crammed = Path(manifest["finetune"]["pattern"].format(model="crammed", vocab=2048, task="sst2", seed=0))
    baseline = Path(manifest["finetune"]["pattern"].format(model="no_pretrain", vocab=2048, task="mnli", seed=1))
    for path, hardware, when in ((crammed, {"gpu": "NVIDIA H200", "cpu": "x"}, "2026-11-26T08:06:28+00:00"),
                                 (baseline, {"gpu": None, "cpu": "Xeon"}, "2026-11-25T21:00:00+00:00")):
        record = json.loads(path.read_text())
        path.write_text(json.dumps(record | {"provenance": {"git_commit": "a" * 40, "hardware": hardware,
                                                            "finished_utc": when}}))
    config = tmp_path / "overlay.yaml"
    config.write_text("glue: {seeds: [0, 1]}\n")
    out, copy = tmp_path / "claims" / "synthetic" / "claims", tmp_path / "readme" / "claims_synthetic.csv"
    subprocess.run([sys.executable, "-m", "cramswarm", "claims", "--manifest", json.dumps(manifest), "--out-stem",
                    str(out), "--copy-to", str(copy), "--config-files", str(config)], check=True, capture_output=True)
    assert copy.read_bytes() == out.with_suffix(".csv").read_bytes()
    assert out.with_suffix(".md").read_text().startswith("| ID |")
    # recorded beside the copy (the claims rule's own output), not in the folder's provenance.json
    assert not (copy.parent / "provenance.json").exists()
    entry = json.loads(docs.sidecar(copy).read_text())
    assert entry["sha256"] == docs.sha256(copy) and entry["from"] == out.with_suffix(".csv").as_posix()
    run = entry["run"]
    assert run["git_commits"] == ["a" * 40] and run["hardware"] == ["NVIDIA H200", "Xeon"]
    assert run["finished_utc"] == ["2026-11-25T21:00:00+00:00", "2026-11-26T08:06:28+00:00"]
    assert run["config_files"] == [{"path": config.as_posix(), "sha256": docs.sha256(config)}]
    assert run["source"] == "synthetic" and run["input_files"] > 100
    # the block's provenance line is this file's own run, not the folder's study record
    line = docs.render_block("claims:synthetic", copy.parent, tmp_path, tmp_path).splitlines()[-1]
    assert "commit `aaaaaaaaaaaa`" in line and "NVIDIA H200, Xeon" in line and "overlay.yaml" in line, line


def test_claims_target_plans_every_experiment_the_claims_read(tmp_path):
    work = copy_workflow(tmp_path)
    jobs = planned_jobs(work, "claims", *TINY)
    assert jobs["claims_table"] == jobs["claims"] == 1
    # the tiny study (4 pretrained + swarm + no_pretrain), arch (base + depth2; bert_original has its own recipe),
    # schedule 2 x 2, data 2 sources x 4 cells (only none / filtered / filtered_sorted are read)
    assert jobs["pretrain"] == 4 + 2 + 4 + 2 * 3
    assert jobs["swarm_pretrain"] == 1 and jobs["init_model"] == 1
    assert jobs["swarm_experiment"] == 5  # every SWARM experiment but sim_scale
    assert "tables" not in jobs and "ablation_data_report" not in jobs  # the claims read the raw results


def test_readme_block_renders_the_committed_claims_csv(manifest, tmp_path):
    from cramswarm.report import docs

    readme = tmp_path / "readme"
    assert "Not committed yet" in docs.render_block("claims:synthetic", readme, tmp_path, tmp_path)
    c.write_claims(manifest, tmp_path / "claims")
    readme.mkdir()
    (readme / "claims_synthetic.csv").write_bytes((tmp_path / "claims.csv").read_bytes())
    body = docs.render_block("claims:synthetic", readme, tmp_path, tmp_path)
    rows = [line for line in body.splitlines() if line.startswith("| C") or line.startswith("| S")]
    assert len(rows) == len(c.CLAIMS)
    assert f"Verdicts: holds {len(c.CLAIMS)}" in body and "claims_synthetic.csv sha256" in body
    with pytest.raises(docs.DocsError, match="source name"):
        docs.render_block("claims:../x", readme, tmp_path, tmp_path)
    # the README's summary: the count and the ids under each verdict, in a few lines
    summary = docs.render_block("claims-summary:synthetic", readme, tmp_path, tmp_path)
    ids = ", ".join(claim.id for claim in c.CLAIMS)
    assert f"**holds** {len(c.CLAIMS)} ({ids})" in summary and "**does not hold** 0;" in summary
    assert len(summary.splitlines()) == 3 and "claims_synthetic.csv sha256" in summary
    with pytest.raises(docs.DocsError, match="source name"):
        docs.render_block("claims-summary:../x", readme, tmp_path, tmp_path)


def test_identical_pairs_at_the_margin_are_inconclusive():
    # e.g. every model at chance on a task: no difference and no spread says nothing about the claim
    outcome = c.paired_greater([0.0, 0.0, 0.0, 0.0])
    assert outcome.verdict == c.INCONCLUSIVE and "all 4 differences equal" in outcome.statistic
    assert c.paired_greater([-1.0, -1.0, -1.0]).verdict == c.FAILS


def test_a_missing_result_file_marks_its_claims_not_run(manifest):
    Path(c.finetune_paths(manifest, "izsak", 2048)[0]).unlink()
    outcomes = by_id(manifest)
    assert outcomes["C4"].verdict == c.NOT_RUN and "1 of 30 input file(s) absent" in outcomes["C4"].measurement
    assert outcomes["C2"].verdict == c.HOLDS


def test_pretraining_gap_plans_only_what_claim_c5_reads(tmp_path):
    work = copy_workflow(tmp_path)
    (work / "config" / "sweep.yaml").write_text("models:\n  crammed:\n    lr_from_sweep: true\n")
    jobs = planned_jobs(work, "pretraining_gap", *TINY, "config/sweep.yaml")
    # crammed at the main vocab only, after the triangle runs of the tiny sweep (lrs 1e-3, 4e-3); no_pretrain's init
    assert jobs["pretraining_gap"] == 1 and jobs["pretrain"] == 1 + 2 and jobs["init_model"] == 1
    assert "swarm_pretrain" not in jobs and "swarm_experiment" not in jobs and "claims_table" not in jobs
    assert jobs["finetune_model"] == 2  # tiny runs one fine-tuning job per model: crammed and no_pretrain
