"""Measured history: one committed CSV per topic under ``results/readme/history/``, one row per dated measurement.

A benchmark run, a timed test tier or a study run made by hand is a measurement of one commit on one machine; its
numbers are history, not guidance. Each topic's file (``<topic>.csv``, e.g. ``benchmarks``, ``swarm``) holds its
rows with the columns of :data:`COLUMNS`:

- ``date`` (``YYYY-MM-DD``, UTC), ``commit`` (the short hash or hashes the numbers were made at; ``-dirty`` when the
  tree had uncommitted changes), ``machine`` (CPU, cores, torch's CPU capability, GPU, load), ``section`` (the
  heading the row is shown under), ``what`` (the measurement in a line), ``command`` (how to measure it again) and
  ``result`` (what it gave, as Markdown);
- ``details`` (optional): a file under ``results/readme/`` (``.md``, ``.csv`` or ``.json``) shown below the row,
  for a measurement's tables; a Markdown file's links are written relative to ``docs/history/``.

:func:`record_history` appends a row (the benchmarks' ``--record`` call it through
:func:`cramswarm.report.docs.record_measurement`, which also redraws the page); :func:`read_history` reads and
checks a file.
``python -m cramswarm docs`` renders a topic as the page ``docs/history/<topic>.md`` (block
``<!-- generated:history:TOPIC -->``, :mod:`cramswarm.report.docs`).
"""

from __future__ import annotations

import csv
import fcntl
import io
import os
import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path

from cramswarm.report.markdown import RESULTS_DIR

COLUMNS = ("date", "commit", "machine", "section", "what", "command", "result", "details")
REQUIRED = ("date", "section", "what", "result")
HISTORY = "history"  # the folder under the committed results folder
TOPIC = re.compile(r"[a-z0-9][a-z0-9_-]*")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


class HistoryError(ValueError):
    """A malformed history file or row."""


def history_file(results_dir: str | os.PathLike, topic: str) -> Path:
    """``<results_dir>/history/<topic>.csv``; the topic is lowercase letters, digits, ``-`` and ``_``."""
    if not TOPIC.fullmatch(topic):
        raise HistoryError(f"history topic {topic!r}: lowercase letters, digits, - and _")
    return Path(results_dir) / HISTORY / f"{topic}.csv"


def check_row(row: dict, where: str = "") -> None:
    """A row has every column, a ``YYYY-MM-DD`` date and the required fields."""
    absent = [c for c in COLUMNS if c not in row]
    if absent:
        raise HistoryError(f"{where}: columns {absent} missing (a history file has {', '.join(COLUMNS)})")
    empty = [c for c in REQUIRED if not str(row[c] or "").strip()]
    if empty:
        raise HistoryError(f"{where}: {', '.join(empty)} empty")
    if not DATE.fullmatch(str(row["date"])):
        raise HistoryError(f"{where}: date {row['date']!r} is not YYYY-MM-DD")


def read_history(path: str | os.PathLike) -> list[dict]:
    """The rows of a history file, in file order (oldest first where rows were appended), each checked."""
    path = Path(path)
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise HistoryError(f"{path}: header {reader.fieldnames}, expected {list(COLUMNS)}")
        rows = [{k: (v or "") for k, v in row.items()} for row in reader]
    for i, row in enumerate(rows, start=2):
        check_row(row, f"{path}:{i}")
    return rows


def git_commit(repo: str | os.PathLike) -> str:
    """``git rev-parse --short HEAD`` of ``repo``, with ``-dirty`` if tracked files differ from it; ``""`` outside
    a git checkout."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return ""
    dirty = git("diff", "--quiet", "HEAD", "--").returncode == 1
    return head.stdout.strip() + ("-dirty" if dirty else "")


def this_machine() -> str:
    """The CPU model, its core count and torch's CPU capability (where torch is installed), and the GPU torch sees."""
    from cramswarm.provenance import hardware

    info = hardware()
    parts = [f"{info['cpu']}, {info['cpu_count']} cores"]
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        parts.append(f"torch {torch.__version__} CPU capability {torch.backends.cpu.get_cpu_capability()}")
        if torch.cuda.is_available():
            parts.append(torch.cuda.get_device_name(0))
    if hasattr(os, "getloadavg"):
        parts.append(f"load average {os.getloadavg()[0]:.1f} when recorded")
    return ", ".join(parts)


def record_history(topic: str, what: str, command: str, result: str, *, section: str, details: str = "",
                   repo: str | os.PathLike = ".", results_dir: str | os.PathLike | None = None,
                   date: str | None = None, commit: str | None = None, machine: str | None = None) -> dict:  # fmt: skip
    """Append one measurement to ``<results_dir>/history/<topic>.csv`` (default ``<repo>/results/readme``) and
    return the row: today's UTC date, ``repo``'s commit (:func:`git_commit`) and this machine
    (:func:`this_machine`) unless given. The row is written with one ``write`` under an exclusive lock on the
    file, the header with the first row, so concurrent appends neither interleave nor repeat the header."""
    results_dir = Path(repo) / RESULTS_DIR if results_dir is None else Path(results_dir)
    path = history_file(results_dir, topic)
    row = {
        "date": date or datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": git_commit(repo) if commit is None else commit,
        "machine": this_machine() if machine is None else machine,
        "section": section, "what": what, "command": command, "result": result, "details": details,
    }  # fmt: skip
    check_row(row, str(path))
    if details and not (results_dir / details).is_file():
        raise HistoryError(f"{path}: details file {details!r} is not under {results_dir}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
        if os.fstat(fd).st_size == 0:
            writer.writeheader()
        writer.writerow(row)
        data = text.getvalue().encode()
        while data:
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    finally:
        os.close(fd)  # releases the lock
    return row
