"""Atomic output helpers: every file the workflow writes appears whole or not at all.

Snakemake deletes a failed job's declared outputs, but a process killed mid-write (OOM, SIGKILL, a
preempted cluster job) can leave a truncated file that a later run would trust. Writing to a temporary
name in the same folder and renaming it into place (``os.replace`` is atomic on POSIX) rules that out.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# mkstemp creates files readable by their owner only; results get the mode a plain open() would give them.
FILE_MODE = 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same suffix); rename it to ``path`` on success, with the
    permissions a newly created file gets under the process umask (not mkstemp's owner-only 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix or ".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        if tmp.exists():  # a writer may have replaced or removed it (then it set its own mode)
            os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file, naming the file if it is missing or corrupt."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"missing file: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"corrupt JSON file {path}: {err}") from None


def read_json_object(path: str | os.PathLike, kind: str, missing: type[Exception] = FileNotFoundError) -> dict:
    """Read a JSON object; errors name ``kind`` and the file (``missing`` is raised for an absent file)."""
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise missing(f"{kind} not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable {kind} ({exc})") from exc
    if not isinstance(record, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(record).__name__}")
    return record
