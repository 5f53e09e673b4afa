"""A real stack for Batch API tests: one engine on the demo model, the gateway, and a Celery worker on the
`batches` queue (Postgres, Redis and the object store are the test session's)."""
from __future__ import annotations

import uuid
from datetime import datetime, timezone

import pytest

from services.adapters.storage import ObjectStore
from services.common.models import Adapter, AdapterStatus, AdapterVersion
from tests.factories import make_base_model
from tests.stack import Stack


@pytest.fixture(scope="module")
def stack(stack_env, demo_kit, tmp_path_factory):
    s = Stack(stack_env, tmp_path_factory.mktemp("batch-stack-logs"))
    s.worker_env = {"MPLEX_BASE_MODEL_DIR": str(demo_kit.base_dir), "MPLEX_BASE_MODEL_NAME": demo_kit.model_name}
    try:
        s.engines = [s.engine(demo_kit.base_dir, demo_kit.model_name, f"beng-{id(s) % 10000}", wait=False)]
        s.gw = s.gateway(demo_kit.base_dir, demo_kit.model_name, wait=False)
        s.wait_ready(*s.engines, s.gw)
        s.batch_worker = s.worker("batches", name="batch-worker", env=s.worker_env)
        yield s
    finally:
        s.close()


def ready_adapter(db, stack_env: dict, demo_kit, tenant, kit_adapter: str, name: str | None = None) -> Adapter:
    """One of the demo kit's trained adapters, stored in the stack's object store and ready for `tenant`."""
    stored = ObjectStore(f"file://{stack_env['MPLEX_HOME']}/objects").put_version(demo_kit.adapters[kit_adapter].path)
    base = _base(db, demo_kit.model_name) or make_base_model(db, name=demo_kit.model_name)
    adapter = Adapter(tenant_id=tenant.id, name=name or f"{kit_adapter}-{uuid.uuid4().hex[:6]}", base_model_id=base.id)
    db.add(adapter)
    db.flush()
    version = AdapterVersion(adapter_id=adapter.id, tenant_id=tenant.id, version=1, base_model_id=base.id,
                             content_sha256=stored.sha256, storage_uri=stored.uri, size_bytes=stored.size_bytes,
                             status=AdapterStatus.READY, ready_at=datetime.now(timezone.utc))
    db.add(version)
    db.flush()
    adapter.active_version_id = version.id
    db.commit()
    return adapter


def _base(db, name: str):
    from sqlalchemy import select

    from services.common.models import BaseModelRecord

    return db.scalar(select(BaseModelRecord).where(BaseModelRecord.name == name))
