"""One set of adapter rules: the engine's loader refuses, with the same code, every adapter the upload
validator refuses -- both call services.common.adapter_files.

The malicious-upload corpus goes through the validator as uploads; for the engine, each case's archive is
laid out as a directory the way a careless extractor would (every regular member by its base name), which
is what an engine would be given if the validator were skipped. Cases that are properties of an archive
and cannot exist as a directory (traversal, links, bombs, unreadable streams) are the validator's alone.
"""
from __future__ import annotations

import io
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath

import pytest
import torch

from services.adapters.config import ArchiveLimits
from services.adapters.validate import validate_upload
from services.common.lora_format import AdapterFormatError
from services.engine.config import ModelConfig
from services.engine.lora.weights import load_lora
from tests.adapters.corpus import build_corpus
from tests.adapters.tinymodel import write_adapter

ARCHIVE_ONLY = {"archive_path_traversal", "archive_path_absolute", "archive_symlink", "archive_hardlink",
                "archive_special_file", "archive_compression_ratio", "archive_too_many_files", "archive_empty",
                "unsupported_upload", "archive_unreadable", "duplicate_file"}


def _as_directory(data: bytes, out: Path) -> bool:
    """Every regular member of the archive written under its base name; False if it is not an archive."""
    out.mkdir(parents=True)
    try:
        if data[:2] == b"PK":
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for info in z.infolist():
                    if not info.is_dir():
                        (out / PurePosixPath(info.filename).name).write_bytes(z.read(info))
            return True
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    (out / PurePosixPath(member.name).name).write_bytes(tar.extractfile(member).read())
        return True
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError, NotImplementedError, zlib.error):
        return False


def _engine(adapter_dir: Path, model: ModelConfig, base_names: tuple[str, ...]) -> str | None:
    try:
        load_lora(adapter_dir, model, max_rank=64, dtype=torch.float32, base_names=base_names)
    except AdapterFormatError as exc:
        return exc.code
    return None


def test_the_engine_refuses_what_the_validator_refuses_with_the_same_code(tmp_path, tiny_base, tiny_dims, tiny_model_info):
    cases, _ = build_corpus(tiny_dims)
    model = ModelConfig.from_dir(tiny_base)
    names = tuple(tiny_model_info.accepted_names)
    compared = 0
    for case in cases:
        upload = tmp_path / f"{case.kind}.upload"
        upload.write_bytes(case.data)
        sandbox = tmp_path / "sandbox" / case.kind
        sandbox.mkdir(parents=True)
        with pytest.raises(AdapterFormatError) as validator:
            validate_upload(upload, sandbox, base=tiny_model_info, limits=ArchiveLimits())
        assert validator.value.code == case.code
        if case.code in ARCHIVE_ONLY or not _as_directory(case.data, tmp_path / "dirs" / case.kind):
            continue
        assert _engine(tmp_path / "dirs" / case.kind, model, names) == case.code, case.kind
        compared += 1
    assert compared >= 25  # most of the corpus is about the files themselves, not the archive around them
    print(f"\n[rules] {compared} of {len(cases)} corpus cases refused by the engine with the validator's code")


def test_both_accept_a_good_adapter_and_agree_on_its_shape(tmp_path, tiny_base, tiny_dims, tiny_model_info):
    adapter = write_adapter(tmp_path / "good", tiny_dims, rank=8, targets=("q_proj", "k_proj", "down_proj"),
                            base_name="tiny-llama")
    model = ModelConfig.from_dir(tiny_base)
    weights = load_lora(adapter, model, max_rank=64, dtype=torch.float32, base_names=tuple(tiny_model_info.accepted_names))
    assert weights.target_modules == ["q_proj", "k_proj", "down_proj"] and weights.max_rank == 8
    # Trained for another base: both refuse it by name.
    other = write_adapter(tmp_path / "other", tiny_dims, rank=4, base_name="meta-llama/Llama-2-70b-hf")
    assert _engine(other, model, tuple(tiny_model_info.accepted_names)) == "base_model_mismatch"
