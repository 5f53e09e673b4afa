"""Static checks of the container images: hadolint, checkov's Dockerfile policies, and the structure we rely
on (multi-stage, pinned bases, non-root, healthcheck, no secrets, a build context that leaves state out)."""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
from ops_support import DOCKER, REPO, checkov, run, tool

DOCKERFILES = {"gateway": DOCKER / "gateway.Dockerfile", "engine": DOCKER / "engine.Dockerfile"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def test_hadolint_is_clean():
    proc = run([tool("hadolint"), "--no-color", *DOCKERFILES.values()])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_checkov_finds_no_failed_dockerfile_checks():
    reports = checkov(DOCKER, "dockerfile", "secrets")
    docker = next(r for r in reports if r["check_type"] == "dockerfile")
    assert docker["summary"]["resource_count"] == len(DOCKERFILES)
    assert docker["summary"]["passed"] > 0
    failed = [f'{c["check_id"]} {c["file_path"]}:{c["file_line_range"]} {c["check_name"]}'
              for r in reports for c in r["results"]["failed_checks"]]
    assert failed == []


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_images_are_multi_stage_with_pinned_bases(image):
    all_stages = stages(DOCKERFILES[image])
    assert len(all_stages) >= 2
    for stage in all_stages:
        base = stage[0][1].split()[0]
        assert "$" not in base, f"{image}: base {base} must be a literal, pinned reference"
        assert re.search(r":[\w.-]*\d[\w.-]*$|@sha256:[0-9a-f]{64}$", base), f"{image}: {base} has no version tag"
        assert not base.endswith(":latest")


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_final_stage_runs_non_root_with_a_healthcheck(image):
    final = stages(DOCKERFILES[image])[-1]
    users = [args for kind, args in final if kind == "USER"]
    assert users, f"{image}: the runtime stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    # The uid the Kubernetes securityContext runs as (local.uid in modules/k8s_app) must exist in the image.
    assert user == "10001"
    assert any("--uid 10001" in args for kind, args in final if kind == "RUN")
    healthchecks = [args for kind, args in final if kind == "HEALTHCHECK"]
    assert len(healthchecks) == 1 and "healthcheck.py" in healthchecks[0]
    assert any(kind == "CMD" for kind, _ in final)


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_no_secrets_are_baked_in(image):
    for kind, args in instructions(DOCKERFILES[image]):
        if kind in ("ENV", "ARG"):
            names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", args) or [args.split("=")[0]]
            for name in names:
                assert not re.search(r"SECRET|PASSWORD|TOKEN|API_KEY|DATABASE_URL|REDIS_URL|BROKER_URL", name), (image, name)


def test_gateway_image_installs_cpu_torch_and_engine_image_cuda_torch():
    gateway = DOCKERFILES["gateway"].read_text()
    engine = DOCKERFILES["engine"].read_text()
    assert "download.pytorch.org/whl/cpu torch==2.13.0" in gateway
    assert re.search(r"FROM nvidia/cuda:12\.\d+\.\d+-runtime", engine)
    assert "whl/cu12" in engine and "torch==2.13.0" in engine and "import services.cli, torch, triton" in engine
    assert re.search(r"FROM node:\S+ AS web", gateway) and "npm run build" in gateway


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        pattern = pattern.removeprefix("**/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern.rstrip("/") + "/"):
            return True
        if any(fnmatch.fnmatch(part, pattern) for part in Path(path).parts):
            return True
    return False


def test_build_context_excludes_state_and_secrets_but_not_what_the_images_copy():
    patterns = _dockerignore()
    for path in (".git/config", ".venv/bin/python", ".venv-tools/bin/checkov", ".mplex/pg/data", ".env",
                 "infra/terraform/examples/aws/terraform.tfstate", "web/node_modules/x/index.js", "server.pem"):
        assert _ignored(path, patterns), f"{path} would enter the build context"
    for image, dockerfile in DOCKERFILES.items():
        for kind, args in instructions(dockerfile):
            if kind == "COPY" and "--from=" not in args:
                for source in args.split()[:-1]:
                    assert not _ignored(source.rstrip("/"), patterns), f"{image} copies {source}, which .dockerignore drops"
                    if source.startswith("infra/"):
                        assert (REPO / source).exists(), f"{image} copies missing {source}"
