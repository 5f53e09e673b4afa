"""`mplex modelkit ...`: build and inspect the demo model kit."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="The demo model kit (model, tokenizer, adapters).")


@app.command()
def build(
    home: Optional[Path] = typer.Option(None, help="State dir (default $MPLEX_HOME or ./.mplex)."),
    force: bool = typer.Option(False, help="Rebuild even when the cached kit is current."),
    quiet: bool = typer.Option(False, help="No progress bars."),
) -> None:
    """Build the demo kit if it is missing or stale (cached under <home>/models/demo)."""
    from services.modelkit import ensure_demo

    kit = ensure_demo(home, force=force, progress=not quiet)
    m = kit.manifest
    typer.echo(f"demo kit: {kit.root}  (model {kit.model_name}, built in {m.get('seconds', '?')} s)")
    typer.echo(f"  base: exact match {m['base']['eval_exact_match']:.0%} on {kit.base_eval.name}")
    for name, a in m["adapters"].items():
        typer.echo(f"  adapter {name:<10} r={a['rank']:<3} exact match {a['eval_exact_match']:.0%}"
                   f" (base alone {a['base_exact_match']:.0%})")


@app.command("pin")
def pin_kit(home: Optional[Path] = typer.Option(None, help="State dir (default $MPLEX_HOME or ./.mplex).")) -> None:
    """Commit-ready copy of the current kit into assets/demo-kit (what fresh machines copy instead of training)."""
    from services.modelkit.kit import pin

    typer.echo(f"pinned the demo kit into {pin(home)}; commit it")


@app.command()
def info(home: Optional[Path] = typer.Option(None, help="State dir (default $MPLEX_HOME or ./.mplex).")) -> None:
    """Print the cached kit's manifest (builds it first if needed)."""
    from services.modelkit import ensure_demo

    typer.echo(json.dumps(ensure_demo(home, progress=False).manifest, indent=2, ensure_ascii=False))


@app.command("random")
def random_model(
    out: Path,
    arch: str = typer.Option("llama", help="llama | mistral | qwen2"),
    seed: int = typer.Option(0),
    hidden: int = typer.Option(64),
    layers: int = typer.Option(2),
) -> None:
    """Write a tiny random-weight checkpoint (for tests and benchmarks)."""
    from services.modelkit import build_tiny_random

    typer.echo(str(build_tiny_random(out, arch=arch, seed=seed, hidden=hidden, layers=layers)))
