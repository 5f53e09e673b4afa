"""The `mplex` command: one entry point, one sub-command group per service."""
from __future__ import annotations

import importlib
import sys

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


def _register(argv: list[str]) -> None:
    """Add the sub-command groups. `mplex <group> ...` imports that group's module only: the others pull in
    torch, transformers and SQLAlchemy (~4 s), which a gateway, a worker or an engine launcher never uses.
    Anything else (`--help`, `mplex up`, a test's CliRunner) gets them all."""
    only = argv[1] if len(argv) > 1 and argv[1] in _GROUPS else None
    for name, target in _GROUPS.items():
        if only is None or name == only:
            module, _, attr = target.partition(":")
            app.add_typer(getattr(importlib.import_module(module), attr or "app"), name=name)


if __name__ != "__mp_main__":  # a multiprocessing child re-imports the main module; it runs no command
    _register(sys.argv)


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
