"""Declarative base for the data model: constraint naming, column type defaults, shared column helpers.

Conventions: UUIDv7 primary keys for anything an API exposes, BIGINT identity for high-volume internal
rows; timestamps are `timestamptz` (UTC, tz-aware); money is BIGINT micro-USD; enums are text + CHECK
(migrations stay plain DDL, no ALTER TYPE dances).
"""
from __future__ import annotations

import enum
import uuid
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import BigInteger, DateTime, Enum, Identity, MetaData, Text, Uuid, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from services.common.ids import uuid7

# Deterministic constraint names: Alembic can then drop/alter them by name on every database.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        datetime: DateTime(timezone=True),
        str: Text(),
        uuid.UUID: Uuid(native_uuid=True),
        dict[str, Any]: JSONB(),
        list[Any]: JSONB(),
    }


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def uuid_pk() -> Mapped[uuid.UUID]:
    # Python-side uuid7 for ORM inserts; gen_random_uuid() so hand-written SQL inserts work too.
    return mapped_column(primary_key=True, default=uuid7, server_default=text("gen_random_uuid()"))


def bigint_pk() -> Mapped[int]:
    return mapped_column(BigInteger, Identity(always=False), primary_key=True)


def created_at() -> Mapped[datetime]:
    return mapped_column(server_default=func.now(), nullable=False)


def updated_at() -> Mapped[datetime]:
    return mapped_column(server_default=func.now(), onupdate=func.now(), nullable=False)


def micros(nullable: bool = False, default: int | None = None) -> Mapped[Any]:
    """An amount of money in micro-USD (1 USD = 1_000_000)."""
    kw: dict[str, Any] = {"nullable": nullable}
    if default is not None:
        kw["server_default"] = text(str(default))
    return mapped_column(BigInteger, **kw)


def str_enum(enum_cls: type[enum.StrEnum], name: str) -> Enum:
    """Stored as its string value in a text column with a CHECK constraint named `ck_<table>_<name>`."""
    return Enum(
        enum_cls,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=32,
        values_callable=lambda e: [m.value for m in e],
        validate_strings=True,
    )
