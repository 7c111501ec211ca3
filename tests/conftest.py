import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_HUB = REPO.parent / "shared" / "data" / "hub"

# The hub cannot be reached from CI; everything real is read from the local mirror.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

requires_mirror = pytest.mark.skipif(
    not (SHARED_HUB / "nyu-mll" / "glue").is_dir(),
    reason=f"offline hub mirror not found at {SHARED_HUB} (the ../shared/data/hub folder beside the repo)",
)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def mirror() -> Path:
    return SHARED_HUB
