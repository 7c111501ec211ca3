"""benchmarks/swarm_compression_link.py's measurements, on made-up runs (no testbed): the two steady rates leave
the start and the final flush out, and the summary tests each scheme against ``none`` across seeds."""

import importlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("hivemind", reason="the benchmark imports the hivemind transport")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
link = importlib.import_module("swarm_compression_link")


def test_the_trainers_rate_leaves_out_the_first_and_the_last_global_batch():
    # 4 microbatches per global batch: a slow start (10 s) and a slow flush (last one 50 s late) do not count
    done = [10.0, 10.5, 11.0, 11.5] + [12.0 + i for i in range(8)] + [20.0, 20.5, 21.0, 70.0]
    assert link.steady_done_mb_s(done, 4) == pytest.approx((12 - 3) / (20.0 - 11.5))
    with pytest.raises(RuntimeError, match="too few microbatches"):
        link.steady_done_mb_s(done[:7], 4)


def test_the_stepped_rate_counts_what_the_last_stage_stepped_between_its_second_and_last_but_one_step():
    log = [{"batch_sequences": 16, "elapsed_s": t} for t in (5.0, 10.0, 15.0, 20.0)] + \
        [{"batch_sequences": 4, "elapsed_s": 90.0}]  # the flush
    assert link.steady_mb_s(log, 4) == pytest.approx(3 * 16 / 4 / 15.0)


def run(scheme, seed, mb_s, loss):
    return {"scheme": scheme, "seed": seed, "mb_s": mb_s, "done_mb_s": mb_s * 1.1, "train_loss": loss,
            "heldout_loss": loss, "boundary_bytes": 100, "lost_microbatches": 0, "lost_gradient_samples": [0, 4],
            "resyncs": 1, "solo_steps": 0}


def test_the_summary_separates_a_real_difference_from_noise(tmp_path, capsys):
    runs = [run("none", s, v, 3.0 + d) for s, (v, d) in enumerate([(1.0, 0.1), (1.1, -0.1), (0.9, 0.0)])]
    runs += [run("blockwise8", s, v, 3.0 + d) for s, (v, d) in enumerate([(2.0, 0.0), (2.1, 0.1), (1.9, -0.1)])]
    rows = {r["scheme"]: r for r in link.summarize(runs, ["none", "blockwise8"])}
    fast = rows["blockwise8"]
    assert fast["mb_s_vs_none"] == pytest.approx(2.0) and fast["mb_s_sd"] == pytest.approx(0.1)
    assert fast["mb_s_p_vs_none"] < 0.01        # twice the rate, ten times the spread apart
    assert fast["heldout_loss_p_vs_none"] > 0.5  # the same losses in another order
    assert fast["lost_gradient_samples"] == 12 and fast["resyncs"] == 3
    assert link.welch_p([1.0], [1.0, 2.0]) is None  # one seed tests nothing
    saved = tmp_path / "runs.json"
    saved.write_text(json.dumps({"runs": runs}))
    assert link.main(["--summarize", str(saved)]) == 0
    table = capsys.readouterr().out
    assert "| blockwise8 | 100 | 2.000 ± 0.100 (p 0.00) | 2.00 |" in table
