"""`mplex db ...`: database migrations (Alembic) against the configured or embedded Postgres."""
from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, help="Database migrations.")


def _url(url: str | None) -> str:
    if url:
        return url
    from services.common.embedded import resolve_urls
    from services.common.settings import get_settings

    return resolve_urls(get_settings()).database_url


@app.command()
def upgrade(
    revision: str = typer.Argument("head", help="Target revision"),
    url: str = typer.Option(None, "--url", help="Database URL (default: MPLEX_DATABASE_URL, else the embedded server)"),
) -> None:
    """Migrate the database up to REVISION (safe to run concurrently: migrations take an advisory lock)."""
    from services.common import migrate

    migrate.upgrade(_url(url), revision)
    typer.echo(f"database at revision {migrate.current_revision(_url(url))}")


@app.command()
def downgrade(
    revision: str = typer.Argument(..., help="Target revision ('base' drops every table)"),
    url: str = typer.Option(None, "--url", help="Database URL (default: MPLEX_DATABASE_URL, else the embedded server)"),
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation"),
) -> None:
    """Migrate the database down to REVISION."""
    from services.common import migrate

    if revision == "base" and not yes:
        typer.confirm("Downgrading to base drops every table and all data. Continue?", abort=True)
    migrate.downgrade(_url(url), revision)
    typer.echo(f"database at revision {migrate.current_revision(_url(url))}")


@app.command()
def current(url: str = typer.Option(None, "--url")) -> None:
    """Print the database's revision and the code's head revision."""
    from services.common import migrate

    typer.echo(f"database: {migrate.current_revision(_url(url))}  head: {migrate.head_revision()}")
