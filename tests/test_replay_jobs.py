"""benchmarks/replay_jobs.py: a dry run's jobs parsed, then run in dependency order; failures stop dependants."""

import importlib.util
import json
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("replay_jobs", ROOT / "benchmarks" / "replay_jobs.py")
replay = importlib.util.module_from_spec(spec)
sys.modules["replay_jobs"] = replay
spec.loader.exec_module(replay)

DRY_RUN = """\
Building DAG of jobs...
[Thu Nov 26 08:04:01 2026]
rule train_tokenizer:
    input: corpus.parquet
    output: tok/tokenizer.json, tok/report.json
    log: logs/tok.log
    jobid: 3
    reason: Missing output files: tok/tokenizer.json
Shell command: python -m cramswarm tokenizer --corpus corpus.parquet > logs/tok.log 2>&1

[Thu Nov 26 08:04:01 2026]
localrule all:
    input: tok/tokenizer.json
    jobid: 0
Shell command: None
"""


def test_dry_run_is_parsed_into_jobs_and_targets_are_left_out():
    jobs = replay.parse_dry_run(DRY_RUN)
    assert jobs == [{"rule": "train_tokenizer", "input": ["corpus.parquet"],
                     "output": ["tok/tokenizer.json", "tok/report.json"], "log": ["logs/tok.log"],
                     "command": "python -m cramswarm tokenizer --corpus corpus.parquet > logs/tok.log 2>&1"}]


def test_jobs_run_after_their_inputs_and_a_failure_skips_its_dependants(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = lambda rule, inputs, out, cmd: {"rule": rule, "input": inputs, "output": [out], "log": [], "command": cmd}  # noqa: E731
    plan = {"jobs": [
        job("finetune", ["a/out.txt"], "b/out.txt", "cat a/out.txt > b/out.txt && echo b >> b/out.txt"),
        job("pretrain", [], "a/out.txt", "sleep 0.3 && echo a > a/out.txt"),
        job("pretrain", [], "c/out.txt", "exit 3"),
        job("finetune", ["c/out.txt"], "d/out.txt", "echo d > d/out.txt"),
        job("report", ["b/out.txt"], "e/out.txt", "true"),  # exits 0 without its output: failed
    ]}  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    rc = replay.main(["run", "plan.json", "--slots", "2", "--record", "record.json"])
    assert rc == 1
    assert (tmp_path / "b/out.txt").read_text() == "a\nb\n"  # ran after its input was written
    record = json.loads((tmp_path / "record.json").read_text())
    states = {row["output"]: row["state"] for row in record["jobs"]}
    assert states == {"b/out.txt": "done", "a/out.txt": "done", "c/out.txt": "failed", "d/out.txt": "skipped",
                      "e/out.txt": "failed"}
    assert not (tmp_path / "d").exists()


def test_nothing_starts_after_the_deadline_and_running_jobs_are_stopped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = {"jobs": [
        {"rule": "pretrain", "input": [], "output": ["a.txt"], "log": [], "command": "sleep 30"},
        {"rule": "finetune", "input": ["a.txt"], "output": ["b.txt"], "log": [], "command": "touch b.txt"},
    ]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert replay.main(["run", "plan.json", "--deadline-s", "1", "--record", "record.json"]) == 1
    record = json.loads((tmp_path / "record.json").read_text())
    assert [row["state"] for row in record["jobs"]] == ["stopped", "not started"]
    assert record["jobs"][0]["returncode"] == -signal.SIGTERM  # stopped by SIGTERM, not the SIGKILL 20 s later
