"""A batch's results streamed to the object store while it runs, in parts.

Answered lines (their result text in Postgres, written with their ledger row by services.batch.checkpoint)
are moved in chunks into part objects `batches/parts/<batch>/<seq>.jsonl`, one kind (output or errors) per
part. A flush writes the object first, then, in one transaction under the batch row's lock, records the part
and points each line at it (clearing its result text). Killed between the two, the object is orphaned and
the next flush writes the same seq again (the lines are still unflushed): no line is lost or written twice.
The batch's output and error files are the concatenation of its parts of that kind in seq order, assembled
when the batch ends (completed, cancelled or expired: a cancel keeps everything already answered).
"""
from __future__ import annotations

import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from services.adapters.storage import ObjectStore
from services.common.batch_contract import OUTPUT_PURPOSE, LineState
from services.common.models import Batch, BatchFile, BatchLine, BatchPart
from services.gateway.batch_files import put_path

PART_LINES = 1000  # answered lines moved per flush at most (a part holds up to this many)
KINDS: dict[str, tuple[LineState, ...]] = {"output": (LineState.DONE,), "errors": (LineState.FAILED, LineState.SKIPPED)}


def parts_prefix(batch_id: uuid.UUID) -> str:
    return f"batches/parts/{batch_id.hex}"


def part_key(batch_id: uuid.UUID, seq: int) -> str:
    return f"{parts_prefix(batch_id)}/{seq:08d}.jsonl"


def flush(session_factory: sessionmaker[Session], store: ObjectStore, batch_id: uuid.UUID, *,
          limit: int = PART_LINES) -> int:
    """Write up to `limit` answered, unflushed lines into new parts; returns how many lines moved."""
    with session_factory() as s, s.begin():
        s.execute(select(Batch.id).where(Batch.id == batch_id).with_for_update())  # the order `record` takes
        return flush_in(s, store, batch_id, limit=limit)


def flush_in(s: Session, store: ObjectStore, batch_id: uuid.UUID, *, limit: int = PART_LINES) -> int:
    """`flush` inside the caller's transaction, which holds the batch row's lock and commits."""
    rows = s.execute(select(BatchLine.line_no, BatchLine.state, BatchLine.result)
                     .where(BatchLine.batch_id == batch_id, BatchLine.state != LineState.PENDING,
                            BatchLine.part_seq.is_(None))
                     .order_by(BatchLine.line_no).limit(limit)).all()
    if not rows:
        return 0
    seq = s.scalar(select(func.coalesce(func.max(BatchPart.seq), 0)).where(BatchPart.batch_id == batch_id))
    with tempfile.TemporaryDirectory(prefix="mplex-batch-part-") as tmp:
        for kind, states in KINDS.items():
            lines = [r for r in rows if r.state in states]
            if not lines:
                continue
            seq += 1
            path = Path(tmp) / f"{seq}.jsonl"
            path.write_bytes(b"".join(r.result.encode() + b"\n" for r in lines))
            stored = store.put_part(path, part_key(batch_id, seq))
            s.add(BatchPart(batch_id=batch_id, seq=seq, kind=kind, storage_uri=stored.uri, line_count=len(lines),
                            bytes=stored.size_bytes))
            s.flush()
            moved = s.execute(update(BatchLine).where(
                BatchLine.batch_id == batch_id, BatchLine.line_no.in_([r.line_no for r in lines]),
                BatchLine.part_seq.is_(None)).values(part_seq=seq, result=None)).rowcount
            assert moved == len(lines), "one writer per batch: nobody else moves its lines"
    return len(rows)


def flush_all(s: Session, store: ObjectStore, batch_id: uuid.UUID) -> None:
    while flush_in(s, store, batch_id) == PART_LINES:
        pass


def assemble(s: Session, store: ObjectStore, b: Batch, kind: str) -> uuid.UUID | None:
    """The batch's `kind` file: its parts concatenated into one stored file (a `batch_files` row); None when
    it has none. Inside the caller's transaction (finalize's)."""
    parts = list(s.scalars(select(BatchPart).where(BatchPart.batch_id == b.id, BatchPart.kind == kind)
                           .order_by(BatchPart.seq)))
    if not parts:
        return None
    with tempfile.TemporaryDirectory(prefix="mplex-batch-out-") as tmp:
        path = Path(tmp) / f"{kind}.jsonl"
        with open(path, "wb") as out:
            for p in parts:
                assert store.copy_to(p.storage_uri, out) == p.bytes, f"part {p.seq} of batch {b.id} changed size"
        row = put_path(store, s, tenant_id=b.tenant_id, path=path, filename=f"batch_{b.id.hex}_{kind}.jsonl",
                       purpose=OUTPUT_PURPOSE, line_count=sum(p.line_count for p in parts))
    return row.id


def drop_objects(store: ObjectStore, batch_id: uuid.UUID) -> int:
    """Delete a finished batch's part objects (after the commit that made its files): their bytes are in
    the files now. The part rows stay, the record of which part each line went out in."""
    return store.delete_parts(parts_prefix(batch_id))


@dataclass(frozen=True, slots=True)
class PartsCheck:
    """What `check` found: answered lines still in Postgres, lines in parts, and the parts' own counts."""

    unflushed: int
    in_parts: int
    parts: int
    counts_agree: bool  # every part's line_count = the lines pointing at it, and its kind = their state's


def check(s: Session, batch_id: uuid.UUID) -> PartsCheck:
    """The parts' integrity (tests call it): each answered line is in Postgres or in exactly one part."""
    unflushed = s.scalar(select(func.count()).where(BatchLine.batch_id == batch_id, BatchLine.state != LineState.PENDING,
                                                    BatchLine.part_seq.is_(None)))
    per_part = dict(s.execute(select(BatchLine.part_seq, func.count()).where(
        BatchLine.batch_id == batch_id, BatchLine.part_seq.is_not(None)).group_by(BatchLine.part_seq)).all())
    parts = list(s.scalars(select(BatchPart).where(BatchPart.batch_id == batch_id)))
    kinds_ok = all(
        not s.scalar(select(func.count()).where(BatchLine.batch_id == batch_id, BatchLine.part_seq == p.seq,
                                                BatchLine.state.not_in(KINDS[p.kind]))) for p in parts)
    agree = kinds_ok and per_part == {p.seq: p.line_count for p in parts}
    return PartsCheck(unflushed, sum(per_part.values()), len(parts), agree)
