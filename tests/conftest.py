import atexit
import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from cramswarm.config import load_config
from cramswarm.data import tokenizer as tokenization
from cramswarm.impl import PRETRAIN_IMPL_KEYS, PretrainImpl

REPO = Path(__file__).resolve().parents[1]
SHARED_HUB = REPO.parent / "shared" / "data" / "hub"

# Processes the tests start (`python -m cramswarm`, Snakemake and SLURM jobs) run this checkout's code as well,
# whichever checkout pip's editable install points at (pyproject's pytest `pythonpath` covers this process only).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))

# torch.compile's on-disk kernel cache, one per test session (removed at exit): kernels an earlier session built
# for another CPU, or under another ISA cap (ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA), crashed or gave NaN when
# reused by the compile tests.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cramswarm-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

# The hub cannot be reached from CI; everything real is read from the local mirror.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

requires_mirror = pytest.mark.skipif(
    not (SHARED_HUB / "nyu-mll" / "glue").is_dir(),
    reason=f"offline hub mirror not found at {SHARED_HUB} (the ../shared/data/hub folder beside the repo)",
)


# Snakemake runs of the workflow (test_workflow, test_slurm): the tiny overlay on top of the default config.
TINY = ["--configfile", "config/config.yaml", "config/test/tiny.yaml"]


def copy_workflow(dest: Path) -> Path:
    """A copy of the workflow (not of results/) to run Snakemake in."""
    for item in ("Snakefile", "rules", "config", "profiles", "envs", "src"):
        src = REPO / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dest / item)
    return dest


def snakemake(cwd, *args, check=True, env=None, timeout=1800):
    proc = subprocess.run(["snakemake", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def job_stats(out: str) -> dict[str, int]:
    """Job counts per rule from the summary table Snakemake prints before it runs anything."""
    if "Job stats:" not in out:  # nothing to be done
        return {}
    table = out.split("Job stats:")[1].split("total")[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}


def planned_jobs(cwd, *args, env=None) -> dict[str, int]:
    """Job counts per rule of a dry run."""
    return job_stats(snakemake(cwd, "-n", *args, env=env).stdout)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def mirror() -> Path:
    return SHARED_HUB


def mirror_corpus(wikipedia_articles: int, gutenberg_books: int) -> list[dict]:
    """A hub corpus spec of the mirror's two real-text datasets, capped at the given document counts."""
    return [
        {"path": "wikimedia/wikipedia", "name": "en-2015-sample", "split": "train", "text_column": "text",
         "max_documents": wikipedia_articles},
        {"path": "bookcorpus-like/gutenberg", "name": None, "split": "train", "text_column": "text",
         "max_documents": gutenberg_books},
    ]


# Pretraining fixtures shared by test_pretrain and test_resume.
DEFAULT = load_config([REPO / "config" / "config.yaml"])


@pytest.fixture
def tiny_run(tmp_path):
    """A corpus with learnable structure: a repeated sentence pattern, tokenized and packed."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    docs = [" ".join(rng.choice(words[:20]) + " " + words[20 + i % 20] for i in range(12)) for _ in range(300)]
    tok = tokenization.train_wordpiece([docs], 96, min_frequency=1)
    tok_path = tmp_path / "tok.json"
    tok.save(str(tok_path))
    ids = [i for d in tok.encode_batch(docs, add_special_tokens=False) for i in d.ids + [tokenization.SEP_ID]]
    blocks = np.array(ids[: len(ids) // 32 * 32], dtype=np.uint16).reshape(-1, 32)
    np.save(tmp_path / "blocks.npy", blocks)
    return tmp_path, tok_path


def recipe(**kw):
    """What the default config's pretraining computes (its pretrain section less impl, schema defaults filled in),
    shrunk to test size. How a run executes goes to :func:`impl`."""
    if moved := sorted(set(kw) & set(PRETRAIN_IMPL_KEYS)):
        raise TypeError(f"{', '.join(moved)}: how a run executes, pass it to impl()")
    base = dict(budget={"unit": "steps", "value": 30}, micro_batch_sequences=8, batch_sequences=16, lr=3e-3,
                warmup_fraction=0.0, precision="auto", eval_blocks=16, eval_points=2)
    return {k: v for k, v in DEFAULT["pretrain"].items() if k != "impl"} | base | kw


def impl(**kw) -> PretrainImpl:
    """How the tests' runs execute: the default config's pretrain.impl on the CPU, a log row every 5 steps."""
    return PretrainImpl.parse(DEFAULT["pretrain"]["impl"] | dict(device="cpu", log_every_steps=5) | kw)


# The default config's arch section (schema defaults filled in), shrunk to test size.
ARCH = DEFAULT["models"]["crammed"]["arch"] | dict(
    layers=1, hidden_size=32, heads=2, intermediate_size=64, max_positions=32
)


class Stop(Exception):
    """What ``killed_at_save`` raises: a kill during a training-state write."""


@contextlib.contextmanager
def killed_at_save(n: int):
    """Run the body with a ``torch.save`` that writes, then raises ``Stop`` on its n-th call: a kill during the
    n-th state write, before its rename. Yields the list of the saved states' steps."""
    import torch

    original, saves = torch.save, []

    def save_then_die(obj, path, *a, **kw):
        original(obj, path, *a, **kw)
        saves.append(obj["counters"]["step"])
        if len(saves) == n:
            raise Stop

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "save", save_then_die)
        with pytest.raises(Stop):
            yield saves


@pytest.fixture
def can_build():
    """Skip (with the reason) where the network testbed's namespaces cannot be made; fail instead where
    CRAMSWARM_REQUIRE_NETNS is set (.ci/run sets it: there a skip would hide an untested testbed)."""
    from cramswarm.testbed import unavailable_reason

    reason = unavailable_reason()
    if reason:
        if os.environ.get("CRAMSWARM_REQUIRE_NETNS"):
            pytest.fail(f"CRAMSWARM_REQUIRE_NETNS is set, but no testbed can be built here: {reason}")
        pytest.skip(reason)



TIERS = ("swarm", "e2e", "slurm", "netns")  # the tiers `python -m pytest` leaves out (pyproject's addopts)


def pytest_collection_modifyitems(config, items):
    """Tests of a tier (real processes, clusters, whole Snakemake runs) get a 15-minute ceiling instead of the
    default 5 (pyproject's ``timeout``), unless they name their own with ``@pytest.mark.timeout``."""
    for item in items:
        if item.get_closest_marker("timeout") is None and any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(pytest.mark.timeout(900))
