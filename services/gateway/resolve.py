"""Resolves a request's `model` to the base model or one of the CALLER's ready adapters.

`name` routes to the adapter's active version (the newest ready one unless rolled back);
`name@version` pins a version. Another tenant's adapter resolves exactly like a missing one.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import and_, select
from sqlalchemy.orm import Session, sessionmaker

from services.common.errors import ModelNotFoundError
from services.common.models import Adapter, AdapterStatus, AdapterVersion
from services.common.models.adapters import ADAPTER_NAME_PATTERN
from services.common.prompting import PromptBuilder


_MODEL_REF = re.compile(ADAPTER_NAME_PATTERN.rstrip("$") + r"(@[1-9][0-9]{0,8})?$")


@dataclass(frozen=True, slots=True)
class BaseModelInfo:
    name: str
    model_dir: Path  # tokenizer + config, for prompt building and context length
    max_model_len: int

    @classmethod
    def from_dir(cls, name: str, model_dir: Path) -> "BaseModelInfo":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return cls(name, Path(model_dir), int(cfg.get("max_position_embeddings", 2048)))


@dataclass(frozen=True, slots=True)
class AdapterTarget:
    adapter_id: uuid.UUID
    version_id: uuid.UUID
    name: str
    version: int
    content_sha256: str
    storage_uri: str


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    requested: str
    base: BaseModelInfo
    adapter: AdapterTarget | None


class ModelResolver:
    def __init__(self, session_factory: sessionmaker[Session], bases: list[BaseModelInfo], ttl_s: float = 2.0):
        self.session_factory = session_factory
        self.bases = {b.name: b for b in bases}
        self.default_base = bases[0]
        self.builders = {b.name: PromptBuilder(b.model_dir) for b in bases}
        self.ttl_s = ttl_s
        self._cache: dict[tuple[uuid.UUID, str], tuple[float, AdapterTarget | None]] = {}

    async def resolve(self, tenant_id: uuid.UUID, model: str) -> ResolvedModel:
        base = self.bases.get(model)
        if base is not None:
            return ResolvedModel(model, base, None)
        if not _MODEL_REF.match(model):
            raise ModelNotFoundError(model[:200])  # cannot name an adapter: no database round trip
        key = (tenant_id, model)
        hit = self._cache.get(key)
        if hit is not None and hit[0] > time.monotonic():
            target = hit[1]
        else:
            target = await asyncio.to_thread(self._lookup, tenant_id, model)
            self._cache[key] = (time.monotonic() + self.ttl_s, target)
            if len(self._cache) > 10_000:
                self._cache.clear()
        if target is None:
            raise ModelNotFoundError(model)
        return ResolvedModel(model, self.default_base, target)

    def _lookup(self, tenant_id: uuid.UUID, model: str) -> AdapterTarget | None:
        name, _, ver = model.partition("@")
        with self.session_factory() as s:
            cond = [Adapter.tenant_id == tenant_id, Adapter.name == name, Adapter.deleted_at.is_(None),
                    AdapterVersion.tenant_id == tenant_id, AdapterVersion.status == AdapterStatus.READY]
            if ver:
                join_on = and_(AdapterVersion.adapter_id == Adapter.id, AdapterVersion.version == int(ver))
            else:
                join_on = AdapterVersion.id == Adapter.active_version_id
            row = s.execute(select(Adapter, AdapterVersion).join(AdapterVersion, join_on).where(*cond)).first()
        if row is None:
            return None
        adapter, v = row
        return AdapterTarget(adapter.id, v.id, adapter.name, v.version, v.content_sha256, v.storage_uri)

    def list_ready(self, tenant_id: uuid.UUID) -> list[tuple[str, int]]:
        """(name, created unix time) of the caller's routable adapters."""
        with self.session_factory() as s:
            rows = s.execute(
                select(Adapter.name, AdapterVersion.created_at)
                .join(AdapterVersion, AdapterVersion.id == Adapter.active_version_id)
                .where(Adapter.tenant_id == tenant_id, Adapter.deleted_at.is_(None),
                       AdapterVersion.status == AdapterStatus.READY)
                .order_by(Adapter.name)
            ).all()
        return [(n, int(c.timestamp())) for n, c in rows]

    def forget(self, tenant_id: uuid.UUID | None = None) -> None:
        if tenant_id is None:
            self._cache.clear()
        else:
            for key in [k for k in self._cache if k[0] == tenant_id]:
                self._cache.pop(key, None)
