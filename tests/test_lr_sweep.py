"""models.NAME.lr_from_sweep: the pretrain command takes its peak LR from the schedule sweep's held-out losses."""

import json
import math

import pytest
from conftest import ARCH, recipe

from cramswarm.cli import main
from cramswarm.pretrain import choose_sweep_lr


def summaries(tmp_path, losses: dict) -> dict:
    out = {}
    for lr, loss in losses.items():
        path = tmp_path / f"lr{lr}" / "summary.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"run": f"sched-triangle-lr{lr}", "eval_loss": loss}))
        out[str(lr)] = str(path)
    return out


def test_the_lowest_finite_held_out_loss_wins(tmp_path):
    chosen = choose_sweep_lr(summaries(tmp_path, {5e-4: 3.2, 2e-3: 2.9, 8e-3: math.nan, 1e-2: None}))
    assert chosen["chosen_lr"] == 2e-3
    assert chosen["eval_loss_by_lr"] == {5e-4: 3.2, 2e-3: 2.9, 8e-3: None, 1e-2: None}
    assert chosen["runs"][2e-3] == "sched-triangle-lr0.002"


def test_a_tie_goes_to_the_smaller_lr_and_no_finite_loss_is_an_error(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    assert choose_sweep_lr(summaries(tmp_path / "a", {2e-3: 3.0, 5e-4: 3.0}))["chosen_lr"] == 5e-4
    with pytest.raises(ValueError, match="no run of the LR sweep has a finite held-out loss"):
        choose_sweep_lr(summaries(tmp_path / "b", {2e-3: None, 5e-4: math.inf}))


def test_pretrain_command_trains_at_the_chosen_lr_and_keeps_the_evidence(tiny_run, tmp_path, capsys):
    folder, tok_path = tiny_run
    sweep = summaries(tmp_path, {1e-4: 4.0, 3e-3: 3.5})
    r = recipe(budget={"unit": "steps", "value": 4}, lr=1.0, eval_points=1)  # lr 1.0 would be the recipe's own
    out = folder / "out"
    assert main(["pretrain", "--recipe", json.dumps(r), "--arch", json.dumps(ARCH), "--blocks",
                 str(folder / "blocks.npy"), "--tokenizer", str(tok_path), "--out-dir", str(out), "--lr-from",
                 json.dumps(sweep), "--quiet", "--threads", "1"]) == 0
    assert "peak LR 0.003 from the schedule sweep" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recipe"]["lr"] == 3e-3
    assert summary["lr_from_sweep"]["chosen_lr"] == 3e-3
    assert summary["lr_from_sweep"]["eval_loss_by_lr"] == {"0.0001": 4.0, "0.003": 3.5}
    log_lrs = [float(line.split(",")[4]) for line in (out / "train_log.csv").read_text().splitlines()[1:]]
    assert max(log_lrs) <= 3e-3 + 1e-12 and max(log_lrs) > 1e-4
