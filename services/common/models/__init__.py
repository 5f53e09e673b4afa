"""The whole data model. Import from here: `from services.common.models import Tenant, ApiKey, ...`.

Schema changes go through Alembic (migrations/); nothing calls `create_all()`.
"""
from services.common.models.adapters import (
    ADAPTER_NAME_PATTERN,
    Adapter,
    AdapterStatus,
    AdapterVersion,
    BaseModelRecord,
    EvalRun,
    EvalRunStatus,
    GateDecision,
)
from services.common.models.audit import AuditLog
from services.common.models.base import Base, utcnow
from services.common.models.batches import Batch, BatchFile, BatchLine, BatchPart
from services.common.models.billing import BillingCursor, Statement, StatementLine, UsageDaily
from services.common.models.identity import ApiKey, Role, User, WebSession
from services.common.models.ledger import EngineUsageReport, UsageEvent, UsageStatus
from services.common.models.pricing import EngineType, Price, TenantPriceOverride
from services.common.models.tenants import SLUG_PATTERN, Tenant, TenantLimits, TenantStatus

__all__ = [
    "ADAPTER_NAME_PATTERN",
    "SLUG_PATTERN",
    "Adapter",
    "AdapterStatus",
    "AdapterVersion",
    "ApiKey",
    "AuditLog",
    "Base",
    "BaseModelRecord",
    "Batch",
    "BatchFile",
    "BatchLine",
    "BatchPart",
    "BillingCursor",
    "EngineType",
    "EngineUsageReport",
    "EvalRun",
    "EvalRunStatus",
    "GateDecision",
    "Price",
    "Role",
    "Statement",
    "StatementLine",
    "Tenant",
    "TenantLimits",
    "TenantPriceOverride",
    "TenantStatus",
    "UsageDaily",
    "UsageEvent",
    "UsageStatus",
    "User",
    "WebSession",
    "utcnow",
]
