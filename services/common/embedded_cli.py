"""`mplex services ...`: the embedded PostgreSQL and Redis of the state directory (dev only)."""
from __future__ import annotations

import json

import typer

app = typer.Typer(no_args_is_help=True, help="Embedded PostgreSQL and Redis for local runs.")


@app.command()
def up() -> None:
    """Start (or reuse) the embedded servers, print their URLs, and leave them running."""
    from services.common.embedded import start_embedded
    from services.common.settings import get_settings

    urls = start_embedded(get_settings().state_dir)
    for name, value in urls.as_env().items():
        typer.echo(f"{name}={value}")


@app.command()
def down() -> None:
    """Stop the embedded servers (whoever started them)."""
    from services.common.embedded import stop_embedded
    from services.common.settings import get_settings

    stop_embedded(get_settings().state_dir)
    typer.echo("stopped")


@app.command()
def status() -> None:
    """Whether the embedded servers are running, and where."""
    from services.common.embedded import embedded_status
    from services.common.settings import get_settings

    typer.echo(json.dumps(embedded_status(get_settings().state_dir), indent=2))
