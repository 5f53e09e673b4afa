"""Validation as plain functions: a good adapter passes with its shape; every case of the malicious corpus is
refused with its own code, nothing is written outside the sandbox, and the sandbox holds at most the two
PEFT files under fixed names."""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from services.adapters.archive import unpack
from services.adapters.config import ArchiveLimits
from services.adapters.upload import pack_dir, pack_files
from services.adapters.validate import validate_dir, validate_upload
from services.common.lora_format import AdapterFormatError, content_id
from tests.adapters.corpus import adapter_tar, build_corpus, good_config, good_weights, reg, tar_gz, zip_bytes
from tests.adapters.tinymodel import write_adapter

LIMITS = ArchiveLimits()


@pytest.fixture(scope="module")
def corpus(tiny_dims):
    return build_corpus(tiny_dims)


def test_a_good_adapter_passes_with_its_shape(tmp_path, tiny_dims, tiny_model_info):
    adapter = write_adapter(tmp_path / "good", tiny_dims, rank=8, targets=("q_proj", "k_proj", "down_proj"),
                            base_name="tiny-llama")
    v = validate_dir(adapter, base=tiny_model_info)
    assert v.content_id == content_id(adapter)
    assert (v.shape.rank, v.shape.alpha, v.shape.target_modules) == (8, 16.0, ("q_proj", "k_proj", "down_proj"))
    assert v.shape.num_layers == tiny_dims.num_layers


@pytest.mark.parametrize("kind", ["tar.gz", "zip", "tar", "loose"])
def test_every_upload_form_unpacks_to_the_same_adapter(tmp_path, tiny_dims, tiny_model_info, kind):
    adapter = write_adapter(tmp_path / "good", tiny_dims, rank=4)
    files = {p.name: p.read_bytes() for p in adapter.iterdir()}
    if kind == "tar.gz":
        data = adapter_tar(json.loads(files["adapter_config.json"]), files["adapter_model.safetensors"],
                           [(reg("README.md"), b"# my adapter")])
    elif kind == "zip":
        data = zip_bytes([("my-adapter/" + n, b) for n, b in files.items()] + [("my-adapter/README.md", b"hi")])
    elif kind == "tar":
        data = pack_dir(adapter, tmp_path / "a.tar").read_bytes()
    else:
        data = pack_files([(p.name, p) for p in adapter.iterdir()], tmp_path / "loose.tar").read_bytes()
    upload = tmp_path / "upload"
    upload.write_bytes(data)
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    v = validate_upload(upload, sandbox, base=tiny_model_info, limits=LIMITS)
    assert v.content_id == content_id(adapter)
    assert sorted(p.name for p in sandbox.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_the_malicious_corpus_is_refused_code_by_code(tmp_path, corpus, tiny_model_info):
    cases, targets = corpus
    assert len({c.kind for c in cases}) >= 15
    got = {}
    for case in cases:
        upload = tmp_path / f"{case.kind}.upload"
        upload.write_bytes(case.data)
        sandbox = tmp_path / "sandboxes" / case.kind
        sandbox.mkdir(parents=True)
        with pytest.raises(AdapterFormatError) as info:
            validate_upload(upload, sandbox, base=tiny_model_info, limits=LIMITS)
        got[case.kind] = info.value.code
        assert info.value.message  # every refusal says what to fix
        # The sandbox holds at most the two files under their fixed names; nothing else is ever created.
        assert {p.name for p in sandbox.rglob("*")} <= {"adapter_config.json", "adapter_model.safetensors"}, case.kind
    assert got == {c.kind: c.code for c in cases}
    for path in targets.values():
        assert not Path(path).exists() and not Path(path).is_symlink(), path
    # Nothing escaped next to the sandboxes either.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{c.kind}.upload" for c in cases] + ["sandboxes"])


def test_zip_bombs_are_refused_before_anything_is_inflated(tmp_path, tiny_dims):
    data = zip_bytes([("adapter_config.json", json.dumps(good_config()).encode()),
                      ("adapter_model.safetensors", b"\x00" * (32 << 20))])
    upload = tmp_path / "bomb.zip"
    upload.write_bytes(data)
    sandbox = tmp_path / "sb"
    sandbox.mkdir()
    with pytest.raises(AdapterFormatError) as info:
        unpack(upload, sandbox, LIMITS)
    assert info.value.code == "archive_compression_ratio"
    assert list(sandbox.iterdir()) == []


def test_caps_on_unpacked_bytes_and_members(tmp_path, tiny_dims):
    w = good_weights(tiny_dims)
    small = ArchiveLimits(max_unpacked_bytes=len(w) - 1, max_files=64)
    upload = tmp_path / "a.tar.gz"
    upload.write_bytes(adapter_tar(good_config(), w))
    sandbox = tmp_path / "sb"
    sandbox.mkdir()
    with pytest.raises(AdapterFormatError) as info:
        unpack(upload, sandbox, small)
    assert info.value.code == "archive_too_large"
    few = ArchiveLimits(max_files=1)
    sandbox2 = tmp_path / "sb2"
    sandbox2.mkdir()
    with pytest.raises(AdapterFormatError) as info:
        unpack(upload, sandbox2, few)
    assert info.value.code == "archive_too_many_files"


def test_member_names_never_steer_a_write(tmp_path, tiny_dims):
    """A nested adapter directory is fine; the files land under fixed names in the sandbox root."""
    cfg, w = json.dumps(good_config()).encode(), good_weights(tiny_dims)
    upload = tmp_path / "nested.tar.gz"
    upload.write_bytes(tar_gz([(reg("a/b/c/adapter_config.json"), cfg), (reg("a/b/c/adapter_model.safetensors"), w)]))
    sandbox = tmp_path / "sb"
    sandbox.mkdir()
    out = unpack(upload, sandbox, LIMITS)
    assert sorted(p.relative_to(sandbox).as_posix() for p in sandbox.rglob("*")) == ["adapter_config.json",
                                                                                       "adapter_model.safetensors"]
    assert out.kind == "tar.gz" and out.unpacked_bytes == len(cfg) + len(w)


def test_auto_mapping_naming_a_transformers_class_is_data(tmp_path, tiny_dims, tiny_model_info):
    """PEFT writes auto_mapping for adapters saved without a task type; only a transformers module is accepted."""
    ok = write_adapter(tmp_path / "ok", tiny_dims, config={"task_type": None, "auto_mapping": {
        "base_model_class": "LlamaForCausalLM", "parent_library": "transformers.models.llama.modeling_llama"}})
    assert validate_dir(ok, base=tiny_model_info).shape.rank == 4
    bad = write_adapter(tmp_path / "bad", tiny_dims, config={"auto_mapping": {
        "base_model_class": "Popen", "parent_library": "subprocess"}})
    with pytest.raises(AdapterFormatError) as info:
        validate_dir(bad, base=tiny_model_info)
    assert info.value.code == "custom_code"
    nested = write_adapter(tmp_path / "nested", tiny_dims, config={"extra": {"deeper": [{"auto_map": {"x": "y.Z"}}]}})
    with pytest.raises(AdapterFormatError) as info:
        validate_dir(nested, base=tiny_model_info)
    assert info.value.code == "custom_code" and "extra.deeper[0].auto_map" in info.value.message


def test_a_stored_version_must_hash_to_its_content_id(tmp_path, tiny_dims, tiny_model_info):
    adapter = write_adapter(tmp_path / "a", tiny_dims)
    with pytest.raises(AdapterFormatError) as info:
        validate_dir(adapter, base=tiny_model_info, expected_content_id="0" * 64)
    assert info.value.code == "content_mismatch"


def test_tar_member_names_are_read_verbatim(tmp_path):
    """Python's tarfile does not strip a leading '/' when reading, so the absolute-path check sees it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("/etc/cron.d/evil")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    upload = tmp_path / "abs.tar"
    upload.write_bytes(buf.getvalue())
    sandbox = tmp_path / "sb"
    sandbox.mkdir()
    with pytest.raises(AdapterFormatError) as info:
        unpack(upload, sandbox, LIMITS)
    assert info.value.code == "archive_path_absolute"
