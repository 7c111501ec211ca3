"""docs/fidelity.md is what the config files resolve to, and every difference from the reference has a reason."""

import shutil

from cramswarm.report import fidelity


def test_committed_fidelity_table_is_what_the_configs_give(repo):
    expected = fidelity.markdown(fidelity.rows(repo))
    committed = (repo / "docs" / "fidelity.md").read_text()
    assert committed == expected, (
        "docs/fidelity.md is stale: run python -m cramswarm fidelity-table --out docs/fidelity.md"
    )


def test_every_difference_from_the_reference_is_explained(repo):
    table = fidelity.rows(repo)
    assert {r["recipe"] for r in table} == {"v1", "icml"}
    assert not [r for r in table if r["verdict"].startswith("DIFFERS")]
    assert sum(r["verdict"] == "equal" for r in table) > 40


def test_a_config_change_shows_up_as_an_undocumented_difference(repo, tmp_path):
    shutil.copytree(repo / "config", tmp_path / "config")
    overlay = tmp_path / "config" / "recipes" / "cramming-icml.yaml"
    text = overlay.read_text()
    izsak = "  izsak:\n    recipe:\n"
    assert izsak in text
    overlay.write_text(text.replace(izsak, izsak + "      lr: 1.0e-3\n      grad_clip_norm: 0.5\n", 1))
    rows = {(r["recipe"], r["section"], r["setting"]): r for r in fidelity.rows(tmp_path)}
    assert rows[("icml", "izsak", "peak LR")]["verdict"] == "DIFFERS (undocumented)"
    assert rows[("icml", "izsak", "peak LR")]["ours"] == "0.001"
    assert rows[("icml", "izsak", "gradient clipping")]["verdict"] == "DIFFERS (undocumented)"
    assert rows[("v1", "izsak", "peak LR")]["verdict"] == "equal"


def test_a_wrong_reference_value_cannot_read_equal(repo, tmp_path):
    """The reference's values are data compared with the resolved config by code: an ICML BERT-original horizon
    typed with v1's arithmetic (the error the hand-typed table had) comes out as a difference, not as equal."""
    import yaml

    doc = yaml.safe_load(fidelity.REFERENCE_FILE.read_text())
    row = next(r for r in doc["settings"] if (r["section"], r["setting"]) == ("bert_original", "schedule"))
    row["icml"]["value"] = row["v1"]["value"]
    wrong = tmp_path / "reference.yaml"
    wrong.write_text(yaml.safe_dump(doc, sort_keys=False))
    rows = {(r["recipe"], r["section"], r["setting"]): r for r in fidelity.rows(repo, wrong)}
    assert rows[("icml", "bert_original", "schedule")]["verdict"] == "DIFFERS (undocumented)"
    assert rows[("v1", "bert_original", "schedule")]["verdict"] == "equal"


def test_a_known_difference_must_name_a_setting(tmp_path):
    import pytest
    import yaml

    doc = yaml.safe_load(fidelity.REFERENCE_FILE.read_text())
    doc["known_differences"].append({"recipe": "*", "section": "crammed", "setting": "no such setting", "why": "x"})
    wrong = tmp_path / "reference.yaml"
    wrong.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(ValueError, match="no such setting"):
        fidelity.reference(wrong)


def test_the_references_warmup_quirk_reads_equal_when_the_option_is_on(repo, tmp_path):
    """glue protocol warmup_from_task cola reproduces the reference's warmup, converted once on CoLA and reused for
    every task; by default each task warms up for its own share, a documented difference."""
    import yaml

    shutil.copytree(repo / "config", tmp_path / "config")
    overlay = tmp_path / "config" / "recipes" / "cramming-icml.yaml"
    doc = yaml.safe_load(overlay.read_text())
    doc.setdefault("glue", {}).setdefault("protocols", {}).setdefault("crammed", {})["warmup_from_task"] = "cola"
    overlay.write_text(yaml.safe_dump(doc, sort_keys=False))
    before = {(r["recipe"], r["setting"]): r for r in fidelity.rows(repo)}
    after = {(r["recipe"], r["setting"]): r for r in fidelity.rows(tmp_path)}
    assert before[("icml", "GLUE warmup per task")]["verdict"] != "equal"
    assert after[("icml", "GLUE warmup per task")]["verdict"] == "equal"
    assert after[("v1", "GLUE warmup per task")]["verdict"] == before[("v1", "GLUE warmup per task")]["verdict"]
