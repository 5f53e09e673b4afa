"""Batch results streamed to the object store: a batch's answered lines are written in parts while it runs.

- batch_parts: one object per part (kind output/errors, its line count and size), keyed (batch, seq).
- batch_lines.part_seq: the part holding a line's result; its `result` text is cleared once the part is in
  the object store (the check constraint now says: answered => result in Postgres xor in a part).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_CHECK = "(state = 'pending') = (result IS NULL)"
_NEW_CHECK = ("CASE WHEN state = 'pending' THEN result IS NULL AND part_seq IS NULL "
              "ELSE (result IS NULL) = (part_seq IS NOT NULL) END")


def upgrade() -> None:
    op.create_table(
        "batch_parts",
        sa.Column("batch_id", sa.Uuid(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("storage_uri", sa.Text(), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("kind IN ('output', 'errors')", name=op.f("ck_batch_parts_kind_known")),
        sa.CheckConstraint("line_count > 0 AND bytes > 0", name=op.f("ck_batch_parts_not_empty")),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name=op.f("fk_batch_parts_batch_id_batches")),
        sa.PrimaryKeyConstraint("batch_id", "seq", name=op.f("pk_batch_parts")),
    )
    op.add_column("batch_lines", sa.Column("part_seq", sa.Integer(), nullable=True))
    op.drop_constraint(op.f("ck_batch_lines_answered_has_result"), "batch_lines", type_="check")
    op.create_check_constraint(op.f("ck_batch_lines_answered_has_result_or_part"), "batch_lines", _NEW_CHECK)


def downgrade() -> None:
    # Results already moved to parts are not copied back: a downgrade refuses while any line has one.
    op.execute("DO $$ BEGIN IF EXISTS (SELECT 1 FROM batch_lines WHERE part_seq IS NOT NULL) THEN "
               "RAISE EXCEPTION 'batch_lines hold results in batch_parts; finish or drop those batches first'; "
               "END IF; END $$")
    op.drop_constraint(op.f("ck_batch_lines_answered_has_result_or_part"), "batch_lines", type_="check")
    op.create_check_constraint(op.f("ck_batch_lines_answered_has_result"), "batch_lines", _OLD_CHECK)
    op.drop_column("batch_lines", "part_seq")
    op.drop_table("batch_parts")
