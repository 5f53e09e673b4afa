"""Ledger rows keep the client's own request id (X-Client-Request-Id) beside the gateway's unique one.

The ledger's request_id must be unique by construction (a client reusing its id must not drop a
second request's usage), so the client's id is recorded separately for tracing.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("usage_events", sa.Column("client_request_id", sa.Text(), nullable=True))
    op.create_index("ix_usage_events_client_request_id", "usage_events", ["client_request_id"])


def downgrade() -> None:
    op.drop_index("ix_usage_events_client_request_id", table_name="usage_events")
    op.drop_column("usage_events", "client_request_id")
