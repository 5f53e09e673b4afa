"""Shared paths and runners for the infra checks: the lint tools live in .venv-tools (make tools)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
TERRAFORM = INFRA / "terraform"
DOCKER = INFRA / "docker"
TOOLS_BIN = REPO / ".venv-tools" / "bin"

# checkov offline: no platform API key, no downloads of guidelines or policies, no version check.
CHECKOV_ENV = {
    **os.environ,
    "BC_SKIP_MAPPING": "TRUE",
    "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false",
    "BC_API_KEY": "",
    "PRISMA_API_URL": "",
    "LOG_LEVEL": "ERROR",
}


def tool(name: str) -> Path:
    path = TOOLS_BIN / name
    assert path.exists(), f"{path} is missing: run `make tools` (make test does it) to create .venv-tools"
    return path


def run(args: list[str | Path], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kw)


@cache
def terraform_inventory() -> dict:
    proc = run([tool("python"), TERRAFORM / "inventory.py", TERRAFORM])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def checkov(directory: Path, *frameworks: str) -> list[dict]:
    """Run checkov offline on a directory; one report per framework."""
    proc = run(
        [tool("checkov"), "--directory", directory, "--framework", *frameworks, "--skip-download",
         "--output", "json", "--compact"],
        env=CHECKOV_ENV, cwd=REPO,
    )
    # Exit code 1 only means "failed checks": the reports say which; anything else is checkov itself failing.
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    reports = json.loads(proc.stdout)
    return reports if isinstance(reports, list) else [reports]


def load_file_module(path: Path) -> ModuleType:
    """Import a standalone script (infra/docker/*.py, infra/grafana/series.py) by path."""
    name = f"_ops_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module
