"""Provenance of a result: what produced it, with which software, on which machine.

Every pretraining summary, random-init summary and fine-tuning result carries a ``provenance`` object, so
a number in a table can be traced to its settings and environment without the Snakemake logs:

* ``settings_sha256``: hash of the settings the job ran with (recipe + arch, or the fine-tuning protocol),
  canonical JSON, so two results with equal hashes ran under equal settings;
* ``seed``; ``packages`` (versions of the libraries that change numbers); ``python``;
* ``hardware``: platform, CPU model and count, the GPU name when one was used; ``hostname``;
* ``git_commit`` of the workflow checkout when it is a git repository (``null`` otherwise);
* ``finished_utc``. Budget used and wall time sit beside it in each record (``tokens``/``steps``/``elapsed_s``
  or ``steps``/``wall_s``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from functools import lru_cache
from importlib import metadata
from pathlib import Path

PACKAGES = (
    "cramswarm", "torch", "transformers", "tokenizers", "datasets", "numpy", "pandas", "scikit-learn", "scipy",
    "seaborn", "matplotlib", "snakemake", "snakemake-executor-plugin-slurm", "hivemind",
)


def settings_hash(settings: object) -> str:
    """SHA-256 of ``settings`` as canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The commit of the checkout this package runs from, or None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def hardware(device: str | None = None) -> dict:
    info = {"platform": platform.platform(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "gpu": None}
    if device is not None and str(device).startswith("cuda"):
        import torch

        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def provenance(settings: object, seed: int | None, device: str | None = None) -> dict:
    return {
        "settings_sha256": settings_hash(settings),
        "seed": seed,
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "hardware": hardware(device),
        "hostname": socket.gethostname(),
        "git_commit": git_commit(),
        "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
