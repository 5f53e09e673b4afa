"""The Batches page in a real browser: a tenant's batches with progress, counts, ETA, downloads and cancel,
against the real stack (the batch runs on the worker and the engine)."""
from __future__ import annotations

import io
import json

from openai import OpenAI
from playwright.sync_api import expect

from tests.web.helpers import sign_in, tid


def _submit(web_stack, n: int, max_tokens: int, tag: str) -> str:
    client = OpenAI(base_url=f"{web_stack.url}/v1", api_key=web_stack.api_key, max_retries=0)
    lines = [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": web_stack.kit.model_name, "messages": [{"role": "user", "content": f"Hello {i}"}],
                       "max_tokens": max_tokens, "ignore_eos": True}} for i in range(n)]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id


def test_tenant_follows_cancels_and_downloads_batches(page, web_stack):
    small = _submit(web_stack, 3, 4, "small")
    big = _submit(web_stack, 300, 64, "big")
    sign_in(page, "member@demo.test")
    tid(page, "nav-batches").click()
    small_row, big_row = tid(page, f"batch-{small}"), tid(page, f"batch-{big}")
    # The page refreshes itself while a batch runs: the small one completes with its output to download.
    expect(small_row.get_by_test_id("batch-status")).to_have_text("completed", timeout=60_000)
    expect(small_row.get_by_test_id("batch-completed")).to_have_text("3 / 3")
    expect(small_row.get_by_test_id("batch-errors-link")).to_have_count(0)
    with page.expect_download() as dl:
        small_row.get_by_test_id("batch-output-link").click()
    lines = [json.loads(x) for x in open(dl.value.path()).read().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == ["small-0", "small-1", "small-2"]
    # The big one shows progress and an ETA, and is cancelled from the page.
    expect(big_row.get_by_test_id("batch-status")).to_have_text("in_progress", timeout=60_000)
    expect(big_row.get_by_test_id("batch-eta")).not_to_have_text("—", timeout=30_000)
    page.once("dialog", lambda d: d.accept())
    big_row.get_by_test_id("batch-cancel").click()
    expect(big_row.get_by_test_id("batch-status")).to_have_text("cancelled", timeout=60_000)
    expect(big_row.get_by_test_id("batch-cancel")).to_have_count(0)
    done = int(big_row.get_by_test_id("batch-completed").inner_text().split("/")[0].replace(",", ""))
    assert 0 < done < 300
    with page.expect_download() as dl:
        big_row.get_by_test_id("batch-errors-link").click()
    skipped = [json.loads(x) for x in open(dl.value.path()).read().splitlines()]
    assert len(skipped) == 300 - done and all(x["error"]["code"] == "batch_cancelled" for x in skipped)
    # The usage page counts the batch lines apart (every line that ran: the small batch's and those answered before the cancel).
    tid(page, "nav-usage").click()
    expect(tid(page, "usage-total-batch")).to_contain_text(f"{3 + done} requests")
