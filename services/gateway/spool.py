"""A durable local spool for usage events while Postgres is unreachable.

Events are appended as JSON lines and fsynced before the request's usage is considered recorded.
Replay renames the active file (new events go to a fresh one), inserts every event idempotently
(the ledger's request id is unique), and deletes the file only after all of them landed.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import orjson


class Spool:
    def __init__(self, directory: Path, name: str = "usage"):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._lock = threading.Lock()

    @property
    def active(self) -> Path:
        return self.dir / f"{self.name}.jsonl"

    def append(self, event: dict) -> None:
        line = orjson.dumps(event) + b"\n"
        with self._lock:
            fd = os.open(self.active, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

    def pending_files(self) -> list[Path]:
        return sorted(self.dir.glob(f"{self.name}.*.replay")) + ([self.active] if self.active.exists() else [])

    def depth(self) -> int:
        return sum(_count_lines(p) for p in self.pending_files())

    def replay(self, insert: Callable[[list[dict]], None], batch: int = 500) -> int:
        """Insert every spooled event with `insert` (must be idempotent). Returns events replayed.

        Stops at the first failure, leaving the remaining files for the next attempt.
        """
        with self._lock:
            if self.active.exists():
                n = len(list(self.dir.glob(f"{self.name}.*.replay")))
                self.active.rename(self.dir / f"{self.name}.{n:06d}.replay")
        done = 0
        for path in sorted(self.dir.glob(f"{self.name}.*.replay")):
            events = list(_read(path))
            for i in range(0, len(events), batch):
                insert(events[i : i + batch])
            done += len(events)
            path.unlink()
        return done


def _read(path: Path) -> Iterable[dict]:
    lines = [ln for ln in path.read_bytes().split(b"\n") if ln.strip()]
    for i, line in enumerate(lines):
        try:
            yield orjson.loads(line)
        except orjson.JSONDecodeError:
            if i == len(lines) - 1:
                return  # torn by a crash mid-append: that append never returned, so nothing relied on it
            raise ValueError(f"{path}: corrupt spool line {i + 1}") from None


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())
