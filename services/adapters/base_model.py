"""The platform's base model as the adapter pipeline sees it: its directory, its `base_models` row, and
the dimensions and names uploaded adapters are checked against."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from services.common.adapter_files import base_name_matcher
from services.common.lora_format import BaseDims
from services.common.models import BaseModelRecord


@dataclass(frozen=True, slots=True)
class BaseModel:
    """What validation needs: the row's id, its dimensions, the rank cap, and the names adapters may give
    in `base_model_name_or_path`."""

    id: object  # uuid.UUID of the base_models row
    name: str
    model_dir: Path | None
    dims: BaseDims
    max_lora_rank: int
    accepted_names: frozenset[str]

    def accepts(self, name_or_path: str | None) -> bool:
        """True when an adapter's `base_model_name_or_path` names this model (or says nothing)."""
        return base_name_matcher(self.accepted_names)(name_or_path)


def base_model_dir(settings) -> Path:
    """The base model's HF directory: the configured one, else the demo kit's (built on first use)."""
    if settings.base_model_dir is not None:
        return Path(settings.base_model_dir)
    from services.modelkit import ensure_demo

    return Path(ensure_demo(settings.home, progress=False).base_dir)


def read_hf_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def base_params(model_dir: Path) -> dict:
    """What a `base_models` row records about a model directory. A directory without the model's dimensions
    (a process that only needs the tokenizer, like a gateway in front of remote engines) gives a row without
    them; the workers, which validate against the dimensions, fill them in from their own copy."""
    raw = read_hf_config(model_dir)
    params = {}
    try:
        params.update(BaseDims.from_hf_config(raw).as_params())
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        pass
    for name in ("vocab_size", "max_position_embeddings"):
        if isinstance(raw.get(name), int):
            params[name] = raw[name]
    if raw.get("_name_or_path"):
        params["name_or_path"] = str(raw["_name_or_path"])
    return params


def ensure_base_model(session: Session, *, name: str, model_dir: Path, max_lora_rank: int = 64) -> BaseModelRecord:
    """Get or create the `base_models` row for the served base (concurrent callers agree on one row).
    `params` holds its dimensions; a row made elsewhere without them gets them filled in."""
    params = base_params(model_dir)
    uri = f"file://{Path(model_dir).resolve()}"
    session.execute(insert(BaseModelRecord).values(name=name, uri=uri, params=params, max_lora_rank=max_lora_rank)
                    .on_conflict_do_nothing(index_elements=[BaseModelRecord.name]))
    row = session.scalar(select(BaseModelRecord).where(BaseModelRecord.name == name))
    assert row is not None
    if not _has_dims(row.params) and _has_dims(params):
        row.params = {**params, **(row.params or {})}
        session.flush()
    return row


def _has_dims(params: dict | None) -> bool:
    return bool(params) and all(k in params for k in BaseDims.__slots__)


def load_base_model(row: BaseModelRecord, *, model_dir: Path | None, max_lora_rank: int,
                    extra_names: tuple[str, ...] = ()) -> BaseModel:
    """The row's dimensions (its params, else the directory's config.json) and accepted names."""
    params = row.params or {}
    if _has_dims(params):
        dims = BaseDims.from_params(params)
    elif model_dir is not None and _has_dims(base_params(model_dir)):
        dims = BaseDims.from_params(base_params(model_dir))
    else:
        raise ValueError(f"base model {row.name!r}: neither its params nor its directory's config.json give its "
                         f"dimensions ({', '.join(BaseDims.__slots__)})")
    names = {row.name, *extra_names}
    for value in (row.uri, str(model_dir) if model_dir else None, params.get("name_or_path")):
        if value:
            value = value.removeprefix("file://").rstrip("/")
            names |= {value, value.rsplit("/", 1)[-1]}
    return BaseModel(row.id, row.name, model_dir, dims, min(row.max_lora_rank, max_lora_rank),
                     frozenset(n.lower() for n in names if n))
