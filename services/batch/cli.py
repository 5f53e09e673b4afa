"""`mplex batch submit|status|download|cancel`: the Batch API from a shell, as a tenant's client (the official
OpenAI SDK against the gateway, with an API key: the same calls any OpenAI client makes)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from services.common.batch_contract import COMPLETION_WINDOWS, ENDPOINTS, TERMINAL

app = typer.Typer(no_args_is_help=True, help="The Batch API: submit a JSONL of requests, follow it, fetch its results.")

BaseUrl = typer.Option("http://127.0.0.1:8000/v1", "--base-url", envvar="MPLEX_BASE_URL", help="The gateway's /v1 URL")
ApiKey = typer.Option(..., "--api-key", envvar="MPLEX_API_KEY", help="An API key with the inference scope")


def _client(base_url: str, api_key: str):
    import openai

    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2)


def _fail(exc: Exception) -> typer.Exit:
    body = getattr(exc, "body", None)
    message = body.get("message") if isinstance(body, dict) else str(exc)
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(1)


def _summary(b) -> str:
    c = b.request_counts
    done = (c.completed + c.failed) if c else 0
    total = c.total if c else 0
    pct = f"{100 * done / total:.0f}%" if total else "-"
    return f"{b.id}  {b.status:<11} {done}/{total} ({pct})  completed={c.completed if c else 0} failed={c.failed if c else 0}"


@app.command()
def submit(
    path: Path = typer.Argument(..., exists=True, dir_okay=False, help="JSONL: one request a line (custom_id, method, url, body)"),
    endpoint: str = typer.Option("/v1/chat/completions", "--endpoint", help=" | ".join(ENDPOINTS)),
    window: str = typer.Option("24h", "--completion-window", help=" | ".join(COMPLETION_WINDOWS)),
    wait: bool = typer.Option(False, "--wait", help="Follow the batch until it ends"),
    base_url: str = BaseUrl,
    api_key: str = ApiKey,
) -> None:
    """Upload the file (every line is checked; errors name the line) and start a batch on it."""
    import openai

    c = _client(base_url, api_key)
    try:
        f = c.files.create(file=(path.name, path.read_bytes()), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window)
    except openai.APIStatusError as exc:
        raise _fail(exc) from None
    typer.echo(_summary(b))
    if wait:
        _follow(c, b.id)


@app.command()
def status(
    batch_id: str = typer.Argument(None, help="A batch id; none: the latest batches"),
    wait: bool = typer.Option(False, "--wait", help="Follow the batch until it ends"),
    as_json: bool = typer.Option(False, "--json", help="The batch object as the API returns it"),
    base_url: str = BaseUrl,
    api_key: str = ApiKey,
) -> None:
    """A batch's status and counts (or the tenant's latest batches)."""
    import openai

    c = _client(base_url, api_key)
    try:
        if batch_id is None:
            for b in c.batches.list(limit=20).data:
                typer.echo(_summary(b))
            return
        if wait:
            _follow(c, batch_id)
            return
        b = c.batches.retrieve(batch_id)
    except openai.APIStatusError as exc:
        raise _fail(exc) from None
    typer.echo(json.dumps(b.model_dump(), indent=2) if as_json else _summary(b))


def _follow(c, batch_id: str) -> None:
    while True:
        b = c.batches.retrieve(batch_id)
        typer.echo(_summary(b), err=True)
        if b.status in TERMINAL:
            return
        time.sleep(2)


@app.command()
def download(
    batch_id: str = typer.Argument(...),
    out: Path = typer.Option(None, "--out", "-o", help="Output file (default: stdout)"),
    errors: bool = typer.Option(False, "--errors", help="The error file instead of the output file"),
    base_url: str = BaseUrl,
    api_key: str = ApiKey,
) -> None:
    """The batch's output file (or error file) as JSONL."""
    import openai

    c = _client(base_url, api_key)
    try:
        b = c.batches.retrieve(batch_id)
        file_id = b.error_file_id if errors else b.output_file_id
        if file_id is None:
            typer.secho(f"no {'error' if errors else 'output'} file (status {b.status})", err=True)
            raise typer.Exit(1 if b.status not in TERMINAL else 0)
        data = c.files.content(file_id).content
    except openai.APIStatusError as exc:
        raise _fail(exc) from None
    if out is None:
        sys.stdout.buffer.write(data)
    else:
        out.write_bytes(data)
        typer.echo(f"{len(data.splitlines())} lines -> {out}", err=True)


@app.command()
def cancel(batch_id: str = typer.Argument(...), base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Stop the batch: lines answered so far stay in its output; the rest go to its error file unrun."""
    import openai

    try:
        typer.echo(_summary(_client(base_url, api_key).batches.cancel(batch_id)))
    except openai.APIStatusError as exc:
        raise _fail(exc) from None
