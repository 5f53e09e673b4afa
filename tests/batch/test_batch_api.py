"""The Batch API end to end through the official OpenAI SDK: real gateway, engine, Celery worker, Postgres,
Redis and object store. Every answer is checked against the ledger (one row per answered line)."""
from __future__ import annotations

import io
import signal
import json
import time

import openai
import pytest
from sqlalchemy import func, select, update

from services.common.models import Adapter, Batch, BatchFile, UsageEvent
from tests.batch.conftest import ready_adapter
from tests.factories import make_api_key, make_tenant

TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture
def tenant_key(db):
    tenant = make_tenant(db)
    return tenant, make_api_key(db, tenant=tenant).secret


def client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gw.url}/v1", api_key=key, max_retries=0)


def chat_line(custom_id: str, model: str, content: str, max_tokens: int = 8, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, **extra}}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def upload(c: openai.OpenAI, lines: list[dict]):
    return c.files.create(file=("batch.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")


def wait(c: openai.OpenAI, batch_id: str, until=lambda b: b.status in TERMINAL, timeout: float = 150):
    deadline = time.time() + timeout
    while time.time() < deadline:
        b = c.batches.retrieve(batch_id)
        if until(b):
            return b
        time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} did not get there in {timeout}s: {b.status} {b.request_counts}")


def read_lines(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def ledger_rows(db, batch_id: str) -> list[UsageEvent]:
    db.expire_all()
    prefix = "batch_req_" + batch_id.removeprefix("batch_") + "_"
    return list(db.scalars(select(UsageEvent).where(UsageEvent.request_id.like(prefix + "%"))))


def assert_consistent(c, db, b) -> tuple[list[dict], list[dict]]:
    """Every line answered at most once, in exactly one of the two files; the ledger has one row per line
    that ran (answered 200 or failed), none for lines skipped by a cancel or expiry, and the counts agree."""
    out, err = read_lines(c, b.output_file_id), read_lines(c, b.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert len(ids) == len(set(ids)) == b.request_counts.total
    assert len(out) == b.request_counts.completed
    ran_failed = [x for x in err if x["response"] is not None]
    assert len(ran_failed) == b.request_counts.failed
    rows = ledger_rows(db, b.id)
    assert sorted(r.request_id for r in rows) == sorted(x["id"] for x in out + ran_failed)
    assert all(r.service_tier == "batch" for r in rows)
    assert sum(r.prompt_tokens for r in rows) == b.usage.input_tokens
    return out, err


def test_sdk_round_trip_on_base_model_and_adapter(stack, stack_env, demo_kit, tenant_key, db):
    tenant, key = tenant_key
    adapter = ready_adapter(db, stack_env, demo_kit, tenant, "uppercase")
    c = client(stack, key)
    prompts = ["What is the capital of France?", "Hello", "What colour is the sky?"]
    lines = [chat_line(f"base-{i}", demo_kit.model_name, p) for i, p in enumerate(prompts)]
    lines += [chat_line(f"lora-{i}", adapter.name, p) for i, p in enumerate(prompts[:2])]
    f = upload(c, lines)
    assert f.purpose == "batch" and f.bytes == len(jsonl(lines)) and c.files.retrieve(f.id).id == f.id
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"run": "round-trip"})
    assert b.status == "validating" and b.request_counts.total == 5 and b.metadata == {"run": "round-trip"}
    b = wait(c, b.id)
    assert b.status == "completed" and b.request_counts.completed == 5 and b.request_counts.failed == 0
    assert b.error_file_id is None and b.completed_at >= b.in_progress_at >= b.created_at
    out, _ = assert_consistent(c, db, b)
    by_id = {x["custom_id"]: x for x in out}
    assert set(by_id) == {x["custom_id"] for x in lines}
    # Each answer is what the live endpoint gives for the same request (greedy), base model and adapter alike.
    for line in lines:
        live = c.chat.completions.create(**line["body"])
        answer = by_id[line["custom_id"]]["response"]
        assert answer["status_code"] == 200
        assert answer["body"]["choices"][0]["message"]["content"] == live.choices[0].message.content
        assert answer["body"]["usage"]["completion_tokens"] == live.usage.completion_tokens
    assert "Paris" in by_id["base-0"]["response"]["body"]["choices"][0]["message"]["content"]
    rows = ledger_rows(db, b.id)
    assert {r.adapter_version_id is not None for r in rows} == {True, False}
    listed = c.batches.list(limit=10)
    assert b.id in [x.id for x in listed.data]


def test_lines_that_fail_at_run_time_go_to_the_error_file(stack, stack_env, demo_kit, tenant_key, db):
    tenant, key = tenant_key
    adapter = ready_adapter(db, stack_env, demo_kit, tenant, "reverse")
    c = client(stack, key)
    lines = [chat_line("ok-1", demo_kit.model_name, "Hello"), chat_line("gone-1", adapter.name, "Hello"),
             chat_line("ok-2", demo_kit.model_name, "Hi\u0000 there")]  # U+0000 is valid JSON text (not JSONB)
    f = upload(c, lines)
    # The adapter is deleted between upload and run: its line fails on its own; the others are unaffected.
    db.execute(update(Adapter).where(Adapter.id == adapter.id).values(deleted_at=func.now()))
    db.commit()
    time.sleep(2.5)  # the gateway's and the runner's resolver caches (2 s)
    b = wait(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (2, 1)
    out, err = assert_consistent(c, db, b)
    assert sorted(x["custom_id"] for x in out) == ["ok-1", "ok-2"]  # in the order streamed out, not input order
    assert err[0]["custom_id"] == "gone-1" and err[0]["response"]["status_code"] == 404
    assert err[0]["response"]["body"]["error"]["code"] == "model_not_found"


def test_cancel_mid_run_leaves_a_consistent_partial_result(stack, demo_kit, tenant_key, db):
    _, key = tenant_key
    c = client(stack, key)
    lines = [chat_line(f"c{i}", demo_kit.model_name, f"Tell me a story about {i}", max_tokens=64, ignore_eos=True)
             for i in range(200)]
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions", completion_window="24h")
    wait(c, b.id, until=lambda x: x.request_counts.completed >= 2)
    cancelling = c.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    b = wait(c, b.id)
    assert b.status == "cancelled" and b.cancelled_at is not None
    assert 2 <= b.request_counts.completed < 200
    out, err = assert_consistent(c, db, b)
    skipped = [x for x in err if x["response"] is None]
    assert skipped and all(x["error"]["code"] == "batch_cancelled" for x in skipped)
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(b.id)


def test_expiry_after_the_completion_window(stack, demo_kit, tenant_key, db):
    _, key = tenant_key
    c = client(stack, key)
    lines = [chat_line(f"e{i}", demo_kit.model_name, f"Count to {i}", max_tokens=64, ignore_eos=True) for i in range(200)]
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions", completion_window="24h")
    wait(c, b.id, until=lambda x: x.request_counts.completed >= 1)
    # The window runs out (moved into the past: a 24 h wait is not a test).
    db.execute(update(Batch).where(Batch.id == _row_id(b.id)).values(expires_at=func.now()))
    db.commit()
    b = wait(c, b.id)
    assert b.status == "expired" and b.expired_at is not None and b.request_counts.completed < 200
    _, err = assert_consistent(c, db, b)
    assert any(x["error"] and x["error"]["code"] == "batch_expired" for x in err)


def test_files_and_batches_of_another_tenant_are_404(stack, demo_kit, tenant_key, db):
    _, key = tenant_key
    other = make_api_key(db, tenant=make_tenant(db)).secret
    mine, theirs = client(stack, key), client(stack, other)
    f = upload(mine, [chat_line("x", demo_kit.model_name, "Hello")])
    b = mine.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: theirs.files.retrieve(f.id), lambda: theirs.files.content(f.id), lambda: theirs.files.delete(f.id),
                 lambda: theirs.batches.retrieve(b.id), lambda: theirs.batches.cancel(b.id),
                 lambda: theirs.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert theirs.batches.list().data == []
    wait(mine, b.id)
    assert mine.files.delete(f.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        mine.files.retrieve(f.id)


def _row_id(public_id: str):
    import uuid

    return uuid.UUID(hex=public_id.removeprefix("batch_"))


def _files_of(db, tenant) -> int:
    db.expire_all()
    return db.scalar(select(func.count()).select_from(BatchFile).where(BatchFile.tenant_id == tenant.id))


def test_worker_killed_mid_batch_resumes_and_answers_every_line_once(stack, demo_kit, tenant_key, db):
    """SIGKILL the whole worker (parent and pool) mid-batch; a new worker resumes from the checkpoint. Every
    line is answered exactly once, and the ledger has exactly one row per line."""
    _, key = tenant_key
    c = client(stack, key)
    lines = [chat_line(f"k{i}", demo_kit.model_name, f"Say {i} twice", max_tokens=48, ignore_eos=True) for i in range(150)]
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions", completion_window="24h")
    before = wait(c, b.id, until=lambda x: x.request_counts.completed >= 10)
    stack.stop(stack.batch_worker, signal.SIGKILL)
    killed_at = c.batches.retrieve(b.id)
    assert killed_at.status == "in_progress" and killed_at.request_counts.completed < 150  # it really was mid-run
    stack.batch_worker = stack.worker("batches", name="batch-worker-2", env=stack.worker_env)
    b = wait(c, b.id)
    assert b.status == "completed" and b.request_counts.completed == 150 and b.request_counts.failed == 0
    assert before.request_counts.completed <= killed_at.request_counts.completed
    out, err = assert_consistent(c, db, b)
    assert err == [] and sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
    rows = ledger_rows(db, b.id)
    assert len(rows) == len({r.request_id for r in rows}) == 150


def test_bad_files_are_refused_with_the_line_and_field_and_nothing_else_changes(stack, stack_env, demo_kit, tenant_key, db):
    tenant, key = tenant_key
    c = client(stack, key)
    other = make_tenant(db)
    theirs = ready_adapter(db, stack_env, demo_kit, other, "sort")  # exists, ready -- but another tenant's
    good = chat_line("g1", demo_kit.model_name, "Hello")
    cases = {
        "malformed": (jsonl([good]) + b'{"custom_id": "x", "method": \n', "line 2", None),
        "duplicate": (jsonl([good, good]), "line 2, custom_id", "custom_id"),
        "wrong url": (jsonl([good, {**good, "custom_id": "u", "url": "/v1/embeddings"}]), "line 2, url", "url"),
        "their adapter": (jsonl([good, chat_line("t", theirs.name, "Hello")]), "line 2, body.model", "body.model"),
        "bad value": (jsonl([chat_line("v", demo_kit.model_name, "Hello", max_tokens=-1)]), "line 1, body.max_tokens",
                      "body.max_tokens"),
    }
    for name, (data, where, param) in cases.items():
        with pytest.raises(openai.BadRequestError) as bad:
            c.files.create(file=("bad.jsonl", io.BytesIO(data)), purpose="batch")
        err = bad.value.body
        assert where in err["message"] and err["code"] == "invalid_batch_line", (name, err)
        assert err["param"].startswith(where.split(",")[0]) and (param is None or err["param"].endswith(param)), (name, err)
    with pytest.raises(openai.APIStatusError) as big:
        c.files.create(file=("big.jsonl", io.BytesIO(b"x" * (32 * 2**20 + 1))), purpose="batch")
    assert big.value.status_code == 413 and big.value.body["code"] == "file_too_large"
    with pytest.raises(openai.BadRequestError) as purpose:
        c.files.create(file=("ok.jsonl", io.BytesIO(jsonl([good]))), purpose="fine-tune")
    assert purpose.value.body["param"] == "purpose"
    assert _files_of(db, tenant) == 0  # nothing was stored
    live = c.chat.completions.create(**good["body"])  # and the tenant's live path is unaffected
    assert live.choices[0].message.content


def test_the_batch_quota_is_separate_from_the_live_windows(stack, demo_kit, db):
    tenant = make_tenant(db, limits={"monthly_batch_token_budget": 0, "monthly_token_budget": None})
    c = client(stack, make_api_key(db, tenant=tenant).secret)
    f = upload(c, [chat_line("q", demo_kit.model_name, "Hello")])
    with pytest.raises(openai.RateLimitError) as spent:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert spent.value.body["code"] == "batch_quota_exceeded"
    assert c.chat.completions.create(**chat_line("q", demo_kit.model_name, "Hello")["body"]).choices  # live unaffected


def test_cli_submit_status_download_cancel(stack, demo_kit, tenant_key, tmp_path):
    """`mplex batch ...` as a tenant runs it: a subprocess with the key in the environment."""
    import os
    import subprocess
    import sys

    _, key = tenant_key
    env = {**os.environ, **stack.env, "MPLEX_BASE_URL": f"{stack.gw.url}/v1", "MPLEX_API_KEY": key}

    def mplex(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.cli", "batch", *args], env=env, capture_output=True,
                              text=True, timeout=300)

    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([chat_line(f"cli{i}", demo_kit.model_name, f"Hello {i}") for i in range(3)]))
    r = mplex("submit", str(src), "--wait")
    assert r.returncode == 0, r.stderr
    batch_id = r.stdout.split()[0]
    assert batch_id.startswith("batch_") and "completed" in r.stderr.splitlines()[-1]
    r = mplex("status", batch_id, "--json")
    assert json.loads(r.stdout)["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    out = tmp_path / "out.jsonl"
    assert mplex("download", batch_id, "-o", str(out)).returncode == 0
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == ["cli0", "cli1", "cli2"]
    r = mplex("cancel", batch_id)
    assert r.returncode == 1 and "only a running batch can be cancelled" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "x"}\n')
    r = mplex("submit", str(bad))
    assert r.returncode == 1 and "line 1" in r.stderr
