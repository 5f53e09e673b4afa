"""Engine time for cost attribution: sample the engine registry and record busy/idle windows.

Engines publish, in their registry snapshot (services.engine.registry), when they started serving, their
wall time since then and their cumulative step time (`busy_s`: the time attributed to requests through the
ledger's compute_us). Each sample closes one window per engine in `engine_usage_reports`: [end of the
previous window (or the engine's start), start + wall], busy = the step time in it, idle = the rest.
Windows are contiguous from the engine's start, so busy + idle over all windows = the engine's wall time.
The previous window comes from Postgres, not from the sampler's memory: any worker can take a sample, a
re-sent window is a no-op (unique engine_id, window_start), and a lost sample just makes the next window longer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import redis
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from services.common.engine_registry import EngineSnapshot, read_snapshots_sync

log = logging.getLogger("mplex.billing.engines")

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_US = timedelta(microseconds=1)


def to_datetime(us: int) -> datetime:
    return EPOCH + timedelta(microseconds=us)


def to_us(t: datetime) -> int:
    return (t - EPOCH) // _US


@dataclass(frozen=True, slots=True)
class EngineSample:
    engine_id: str
    engine_type: str
    base_model: str | None
    started_us: int  # epoch microseconds: the origin of this engine incarnation's accounting
    wall_us: int  # since started
    busy_us: int  # cumulative step time since started

    @classmethod
    def from_snapshot(cls, s: EngineSnapshot) -> EngineSample | None:
        """None for engines that do not publish time accounting (older builds)."""
        if not s.accounts_time:
            return None
        return cls(s.id, str(s.engine_type), s.base_model or None, round(s.started_at * 1e6), round(s.wall_s * 1e6),
                   round(s.busy_s * 1e6))


@dataclass(frozen=True, slots=True)
class Window:
    engine_id: str
    window_start: datetime
    window_end: datetime
    busy_us: int
    idle_us: int
    inserted: bool  # False: the same window was already recorded (a re-sent sample)


def read_registry(client: redis.Redis) -> list[EngineSample]:
    """Every live registry entry that carries time accounting."""
    return [s for s in map(EngineSample.from_snapshot, read_snapshots_sync(client)) if s is not None]


def record_sample(session: Session, sample: EngineSample) -> Window | None:
    """Close the window from the engine's last recorded one to this sample. Commits. None: no time passed."""
    session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"), {"k": f"mplex.engine-usage:{sample.engine_id}"})
    started = to_datetime(sample.started_us)
    prev_busy, last_end = session.execute(
        text("SELECT coalesce(sum(busy_us), 0)::bigint, max(window_end) FROM engine_usage_reports "
             "WHERE engine_id = :e AND window_start >= :started"),
        {"e": sample.engine_id, "started": started},
    ).one()
    start = last_end or started
    end = to_datetime(sample.started_us + sample.wall_us)
    if end <= start:
        session.commit()
        return None
    wall = to_us(end) - to_us(start)
    # Step time can only fall inside wall time; a sample taken between a step's end and its bookkeeping
    # carries the excess into the next window (prev_busy only counts what was recorded).
    busy = min(max(sample.busy_us - prev_busy, 0), wall)
    inserted = session.execute(
        text("INSERT INTO engine_usage_reports (engine_id, engine_type, base_model, window_start, window_end, busy_us, idle_us) "
             "VALUES (:e, :t, :m, :s, :end, :b, :i) ON CONFLICT (engine_id, window_start) DO NOTHING"),
        {"e": sample.engine_id, "t": sample.engine_type, "m": sample.base_model, "s": start, "end": end, "b": busy, "i": wall - busy},
    ).rowcount
    session.commit()
    return Window(sample.engine_id, start, end, busy, wall - busy, bool(inserted))


def sample_engines(session_factory: sessionmaker[Session], client: redis.Redis) -> list[Window]:
    """One registry sample -> one window per engine (the periodic billing task)."""
    windows = []
    for sample in read_registry(client):
        with session_factory() as session:
            w = record_sample(session, sample)
        if w is not None:
            windows.append(w)
    return windows


@dataclass(frozen=True, slots=True)
class EngineTotals:
    engine_id: str
    busy_us: int
    idle_us: int
    first_start: datetime
    last_end: datetime


def engine_totals(session: Session, engine_ids: list[str]) -> dict[str, EngineTotals]:
    rows = session.execute(
        text("SELECT engine_id, sum(busy_us)::bigint, sum(idle_us)::bigint, min(window_start), max(window_end) "
             "FROM engine_usage_reports WHERE engine_id = ANY(:ids) GROUP BY engine_id"),
        {"ids": engine_ids},
    )
    return {r[0]: EngineTotals(*r) for r in rows}
