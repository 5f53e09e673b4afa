"""The `mplex` command: one entry point, one sub-command group per service."""
from __future__ import annotations

import importlib

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Multiplex platform tools.")

# Each service owns its commands in services/<name>/cli.py as a `typer.Typer` named `app` (`module:attr` names another).
_GROUPS = {
    "modelkit": "services.modelkit.cli",
    "engine": "services.engine.cli",
    "db": "services.common.cli",
    "services": "services.common.embedded_cli",
    "gateway": "services.gateway.cli",
    "admin": "services.gateway.admin_cli",
    "billing": "services.billing.cli",
    "adapters": "services.adapters.cli",
    "batch": "services.batch.cli",
    "worker": "services.common.worker_cli",
    "beat": "services.common.worker_cli:beat_app",
}


def _register() -> None:
    for name, target in _GROUPS.items():
        module, _, attr = target.partition(":")
        app.add_typer(getattr(importlib.import_module(module), attr or "app"), name=name)


_register()


@app.command()
def up() -> None:
    """Run the platform locally in the foreground (Ctrl-C stops everything it started)."""
    import os
    from pathlib import Path

    from services.devstack import run_up

    run_up(Path(os.environ.get("MPLEX_HOME", ".mplex")).resolve())


def main() -> None:
    app()


if __name__ == "__main__":
    main()
