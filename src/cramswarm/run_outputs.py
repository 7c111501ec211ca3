"""What every pretraining run writes to its output folder, whichever trainer ran it (one process, data-parallel
processes, or a SWARM): the checkpoint, ``train_log.csv`` and ``summary.json``, with the summary keys they share."""

from __future__ import annotations

from pathlib import Path

import torch

from cramswarm.io import atomic_path, write_json
from cramswarm.precision import Precision
from cramswarm.provenance import provenance
from cramswarm.training import save_checkpoint


def summary(*, run: str | None, steps: int, tokens: int, data_passes: float, elapsed_s: float, final_loss: float,
            eval_loss: float | None, model: torch.nn.Module, recipe: dict, arch: dict, precision: Precision,
            device: str, settings: dict, trained_on: str) -> dict:
    """The keys every pretraining summary holds. ``settings`` are what the provenance record fingerprints (the
    recipe and arch, and a SWARM run's swarm settings); ``trained_on`` the hardware it records."""
    return {
        "run": run,
        "steps": steps,
        "tokens": tokens,
        "epochs_of_data": round(data_passes, 4),
        "elapsed_s": round(elapsed_s, 2),
        "tokens_per_s": round(tokens / elapsed_s, 1) if elapsed_s > 0 else None,
        "final_loss": round(final_loss, 5),
        "eval_loss": eval_loss,
        "parameters": sum(p.numel() for p in model.parameters()),
        "budget": recipe["budget"],
        "precision": precision.name,
        "precision_reason": precision.reason,
        "device": device,
        "recipe": recipe,
        "arch": arch,
        "pretrained": True,
        "provenance": provenance(settings, recipe["seed"], trained_on),
    }


def write_outputs(out_dir: str | Path, model: torch.nn.Module, tok, max_positions: int, log_csv: str,
                  run_summary: dict) -> dict:
    """The checkpoint (model and tokenizer), then ``train_log.csv``, then ``summary.json``, each atomically."""
    out_dir = Path(out_dir)
    save_checkpoint(model, tok, out_dir, max_positions)
    with atomic_path(out_dir / "train_log.csv") as tmp:
        tmp.write_text(log_csv)
    write_json(out_dir / "summary.json", run_summary)
    return run_summary
