"""`mplex adapters ...`: upload an adapter for a tenant, follow its version through the pipeline, seed the
demo adapters, and the pipeline's upkeep (retired set, sweep) — straight against the platform database and
object store, with the same plain functions as the HTTP API (actor = the OS user, via "cli")."""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, help="Adapters: upload, status, demo seed, pipeline upkeep.")


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(1)


def _version_dict(v) -> dict:
    return {"version_id": str(v.id), "adapter_id": str(v.adapter_id), "version": v.version, "status": str(v.status),
            "progress": {"percent": v.progress_percent, "step": v.progress_step}, "reasons": v.status_reasons,
            "content_sha256": v.content_sha256, "eval": v.eval_summary and {k: v.eval_summary.get(k) for k in
                                                                             ("passed", "metrics", "thresholds")}}


@app.command()
def upload(
    path: Path = typer.Argument(..., exists=True, help="An adapter directory (the two PEFT files), a .tar.gz or a .zip"),
    tenant: str = typer.Option(..., "--tenant", help="Tenant slug or id"),
    name: str = typer.Option(None, "--name", help="Adapter name (an existing name gets a new version); default: "
                                                  "the directory's or archive's name"),
    eval_set: Path = typer.Option(None, "--eval-set", exists=True, dir_okay=False, help="JSONL eval set"),
    min_margin: float = typer.Option(None, "--min-margin", help="Gate: adapter must beat the base by this much"),
    min_fp8_agreement: float = typer.Option(None, "--min-fp8-agreement", help="Gate: FP8 vs full-precision token agreement"),
    wait: bool = typer.Option(False, "--wait", help="Follow the version until it is ready or rejected"),
    inline: bool = typer.Option(False, "--inline", help="Run validation and the gate in this process (no worker needed)"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output"),
) -> None:
    """Upload an adapter version for a tenant; validation and the quality gate run on the workers."""
    from services.adapters.upload import private_dir, upload_from_path
    from services.common.errors import ApiError
    from services.common.settings import get_settings

    settings = get_settings()
    name = name or default_name(path)
    with private_dir(settings.home / "sandbox", "cli-") as tmp:
        try:
            result = upload_from_path(path, tenant=tenant, name=name, eval_set=eval_set.read_bytes() if eval_set else None,
                                 min_margin=min_margin, min_fp8_agreement=min_fp8_agreement, staging=tmp)
        except ApiError as exc:
            raise _fail(exc.message) from None
    if inline:
        from services.adapters.pipeline import InlineEnqueue, build_runtime

        enqueue = InlineEnqueue()
        enqueue.runtime = build_runtime(settings, enqueue=enqueue)
        enqueue.ingest(result.version_id)
    else:
        from services.adapters.tasks import enqueue_ingest

        if not enqueue_ingest(result.version_id):
            typer.secho("warning: the broker is unreachable; the version will be picked up by the sweep", err=True)
    out = result.as_response()
    if wait or inline:
        out = _follow(result.version_id, quiet=as_json)
    typer.echo(json.dumps(out, indent=2) if as_json else
               f"{name} v{out['version']}: {out['status']} (version id {out['version_id']})")
    if out["status"] == "rejected":
        raise typer.Exit(2)


def default_name(path: Path) -> str:
    """`mplex adapters upload ./support-bot.tar.gz` names the adapter `support-bot`."""
    name = path.resolve().name
    for suffix in (".tar.gz", ".tgz", ".tar", ".zip"):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def _follow(version_id: uuid.UUID, *, quiet: bool, timeout_s: float = 3600) -> dict:
    from services.common.db import session_scope
    from services.common.models import AdapterVersion

    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        with session_scope() as s:
            v = s.get(AdapterVersion, version_id)
            info = _version_dict(v)
        step = (info["status"], info["progress"]["percent"], info["progress"]["step"])
        if step != last and not quiet:
            typer.echo(f"  {info['status']:<10} {info['progress']['percent']:>3}%  {info['progress']['step'] or ''}", err=True)
            last = step
        if info["status"] in ("ready", "rejected") or time.monotonic() > deadline:
            for r in info["reasons"] or []:
                if not quiet:
                    typer.echo(f"  reason: {r.get('code')}: {r.get('message')}", err=True)
            return info
        time.sleep(1.0)


@app.command()
def show(version_id: str = typer.Argument(..., help="Adapter version id")) -> None:
    """One version: status, progress, reasons, gate metrics."""
    from services.common.db import session_scope
    from services.common.models import AdapterVersion

    try:
        vid = uuid.UUID(version_id)
    except ValueError:
        raise _fail("not a version id") from None
    with session_scope() as s:
        v = s.get(AdapterVersion, vid)
        if v is None:
            raise _fail("no such version")
        typer.echo(json.dumps(_version_dict(v), indent=2, default=str))


@app.command("seed-demo")
def seed_demo(tenant: str = typer.Option("demo", "--tenant", help="Tenant slug or id"),
              wait: bool = typer.Option(False, "--wait", help="Wait until every demo adapter is decided")) -> None:
    """Upload the demo kit's adapters for a tenant (idempotent: same content, same version)."""
    from services.adapters.seed import seed_demo_adapters, wait_until_decided

    seeded = seed_demo_adapters(tenant=tenant)
    for s in seeded:
        typer.echo(f"{s.name}: v{s.version} {s.status}{'' if s.created else ' (already uploaded)'}")
    if wait:
        for vid, status in wait_until_decided([s.version_id for s in seeded]).items():
            typer.echo(f"{vid}: {status}")


@app.command("sync-retired")
def sync_retired_cmd() -> None:
    """Rebuild the Redis set of deleted adapters' content ids that engines unload (beat does it every 10 s)."""
    from services.adapters.tasks import sync_retired_adapters

    typer.echo(f"{sync_retired_adapters()} retired content ids")


@app.command("collect-storage")
def collect_storage_cmd() -> None:
    """Remove files past their retention, unreferenced objects and stale temporary files (beat: hourly)."""
    from services.adapters.tasks import collect_storage

    typer.echo(json.dumps(collect_storage()))


@app.command()
def sweep() -> None:
    """Re-enqueue versions whose pipeline task was lost (beat does it every minute)."""
    from services.adapters.tasks import sweep as sweep_task

    typer.echo(f"{sweep_task()} versions re-enqueued")
