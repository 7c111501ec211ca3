"""The study record: benchmark files summed per rule, software versions, the config as written."""

import pandas as pd
import pytest
import yaml

from cramswarm.io import FILE_MODE
from cramswarm.report.record import benchmark_table, read_benchmarks, software_table, write_record

HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def write_bench(path, seconds, rss, cpu="1.0"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + f"{seconds}\t0:00:01\t{rss}\t1\t1\t1\t0\t0\t0\t{cpu}\n")


@pytest.fixture
def benchmarks(tmp_path):
    folder = tmp_path / "benchmarks"
    write_bench(folder / "finetune" / "synthetic" / "crammed" / "sst2" / "s0.tsv", 10.0, 300.0)
    write_bench(folder / "finetune" / "synthetic" / "crammed" / "sst2" / "s1.tsv", 14.0, 320.0)
    write_bench(folder / "pretrain" / "synthetic" / "crammed" / "v128.tsv", 100.0, 900.0, cpu="NA")
    return folder


def test_benchmarks_are_summed_per_rule(benchmarks):
    raw = read_benchmarks(benchmarks)
    assert sorted(raw["job"]) == [
        "finetune/synthetic/crammed/sst2/s0",
        "finetune/synthetic/crammed/sst2/s1",
        "pretrain/synthetic/crammed/v128",
    ]
    table = benchmark_table(raw).set_index("rule")
    assert list(table.index) == ["pretrain", "finetune"]  # largest total wall time first
    assert table.loc["finetune"].to_dict() == pytest.approx(
        {
            "jobs": 2,
            "wall_s_total": 24.0,
            "wall_s_mean": 12.0,
            "wall_s_max": 14.0,
            "cpu_s_total": 2.0,
            "max_rss_mb": 320.0,
        }
    )
    assert pd.isna(table.loc["pretrain", "cpu_s_total"])  # "NA" (not measured) stays missing, not 0


def test_a_malformed_benchmark_file_is_named(tmp_path):
    bad = tmp_path / "b" / "rule" / "job.tsv"
    bad.parent.mkdir(parents=True)
    bad.write_text("seconds\n1\n")
    with pytest.raises(ValueError, match="job.tsv.*missing column"):
        read_benchmarks(tmp_path / "b")


def test_record_writes_config_software_and_benchmark_summary(benchmarks, tmp_path):
    config = {"source": "synthetic", "tokenizer": {"vocab_sizes": [128, 160]}}
    paths = write_record(config, benchmarks, tmp_path / "record")
    assert yaml.safe_load(paths["config"].read_text()) == config
    software = pd.read_csv(paths["software"]).set_index("component")["version"]
    assert {"torch", "snakemake", "hivemind", "python", "git commit"} <= set(software.index)
    assert pd.read_csv(paths["benchmarks"])["jobs"].sum() == 3
    caption = paths["rule_times"].with_suffix(".caption.rst").read_text()
    assert "3 job(s)" in caption and "pretrain (100 s over 1 job(s), 81 %)" in caption
    assert paths["rule_times"].with_suffix(".pdf").is_file()
    for path in paths.values():  # atomic writes keep the umask's mode, not mkstemp's owner-only 0600
        assert path.stat().st_mode & 0o777 == FILE_MODE


def test_software_table_names_missing_packages():
    table = software_table()
    assert (table["version"] != "").all() and not table["version"].isna().any()


def test_no_benchmarks_is_an_error_for_the_figure(tmp_path):
    with pytest.raises(ValueError, match="no benchmark files"):
        write_record({}, tmp_path / "empty", tmp_path / "out")
