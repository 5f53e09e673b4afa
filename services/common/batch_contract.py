"""The Batch API's one owner: limits, statuses, id shapes, the JSONL input line and the output/error line
shapes, and the Celery task names. The gateway (upload, API), the batch runner (services.batch), the CLI
and the web app's API all import these; docs/api.md ("Batch API") states them for people.
"""
from __future__ import annotations

import enum
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# A batch input file: at most this many bytes and lines (OpenAI's are 200 MB / 50,000; ours is sized for
# one gateway holding the upload in memory while it validates every line).
MAX_FILE_BYTES = 32 * 2**20
MAX_LINES = 50_000
MAX_LINE_ERRORS = 20  # line errors named in one refusal (the count says how many there were)
COMPLETION_WINDOWS = {"24h": 24 * 3600}
# The endpoints a line may name, and the request kind the live path plans it as.
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
FILE_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
FILE_PREFIX, BATCH_PREFIX, LINE_PREFIX = "file-", "batch_", "batch_req_"
LIST_LIMIT_MAX = 100
SERVICE_TIER = "batch"  # usage_events.service_tier of a batch line (live requests: LIVE_TIER)
LIVE_TIER = "default"  # the service tier of live requests (usage_events, usage_daily, statement_lines)

TASK_RUN = "batches.run"  # (batch id): run a batch's pending lines; idempotent, one runner per batch
TASK_SWEEP = "batches.sweep"  # resume orphaned batches, expire overdue ones
QUEUE = "batches"


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TERMINAL = frozenset({BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})


class LineState(enum.StrEnum):
    PENDING = "pending"
    DONE = "done"  # answered 200: in the output file
    FAILED = "failed"  # failed on its own account: in the error file
    SKIPPED = "skipped"  # never run (batch cancelled or expired): in the error file, not billed


# -- ids ------------------------------------------------------------------------------------------------
def file_public_id(file_id: uuid.UUID) -> str:
    return FILE_PREFIX + file_id.hex


def batch_public_id(batch_id: uuid.UUID) -> str:
    return BATCH_PREFIX + batch_id.hex


def parse_public_id(value: str, prefix: str) -> uuid.UUID | None:
    """The row id behind `file-…` / `batch_…`; None for anything else (answered as a 404)."""
    if not value.startswith(prefix) or len(value) != len(prefix) + 32:
        return None
    try:
        return uuid.UUID(hex=value[len(prefix):])
    except ValueError:
        return None


def line_request_id(batch_id: uuid.UUID, line_no: int) -> str:
    """The ledger's request id of one line: deterministic, so a re-run line can never be metered twice."""
    return f"{LINE_PREFIX}{batch_id.hex}_{line_no}"


# -- the input line ---------------------------------------------------------------------------------------
class InputLine(BaseModel):
    """One JSONL line as OpenAI defines it. `body` is checked separately, as a live request would be."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: Literal["/v1/chat/completions", "/v1/completions"]
    body: dict[str, Any]


class LineError(BaseModel):
    """One refused line, numbered from 1 as editors number them."""

    line: int
    param: str | None = None
    code: str | None = None
    message: str

    def describe(self) -> str:
        where = f"line {self.line}" + (f", {self.param}" if self.param else "")
        return f"{where}: {self.message}"


# -- output and error lines ---------------------------------------------------------------------------------
def output_line(batch_id: uuid.UUID, line_no: int, custom_id: str, status_code: int, body: dict | None,
                error: dict | None = None) -> dict:
    """An output (or error) file line, in OpenAI's shape."""
    rid = line_request_id(batch_id, line_no)
    response = None if body is None else {"status_code": status_code, "request_id": rid, "body": body}
    return {"id": rid, "custom_id": custom_id, "response": response, "error": error}
