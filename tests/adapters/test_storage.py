"""The content-addressed object store: versions keyed by their files' bytes and identified by content id,
immutable objects, fetch round trips, and the engine's loader reading a stored version straight from its URI."""
from __future__ import annotations

import json

import pytest
import torch

from services.adapters.storage import ObjectStore, StorageError, file_sha256, files_sha256
from services.common.lora_format import content_id
from tests.adapters.tinymodel import write_adapter


def test_versions_are_keyed_by_their_bytes_and_stored_once(tmp_path, tiny_dims):
    store = ObjectStore(f"file://{tmp_path / 'objects'}")
    adapter = write_adapter(tmp_path / "a", tiny_dims, rank=4)
    stored = store.put_version(adapter)
    key = files_sha256(adapter)
    assert stored.sha256 == content_id(adapter) != key
    assert stored.uri == f"file://{tmp_path / 'objects'}/adapters/{key}"
    assert stored.size_bytes == sum(p.stat().st_size for p in adapter.iterdir())
    # Same content again: same object, nothing rewritten.
    weights = tmp_path / "objects" / "adapters" / key / "adapter_model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert store.put_version(adapter) == stored
    assert weights.stat().st_mtime_ns == mtime
    # Fetch returns the identical two files.
    out = store.fetch(stored.uri, tmp_path / "fetched")
    assert content_id(out) == stored.sha256
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not list((tmp_path / "objects" / "adapters" / key).glob(".tmp-*"))


def test_configs_that_share_a_content_id_are_stored_apart(tmp_path, tiny_dims):
    """Same weights and output-relevant fields, another config otherwise (a foreign auto_mapping): one content id
    (engines may share its KV) but two objects, so each upload is validated as it was sent — whichever came
    first, a clean upload never inherits a hostile config, nor a hostile one a clean config."""
    store = ObjectStore(str(tmp_path / "objects"))
    hostile = write_adapter(tmp_path / "hostile", tiny_dims, rank=4, seed=3, config={"auto_mapping": {"base_model_class": "Evil", "parent_library": "os"}})
    clean = write_adapter(tmp_path / "clean", tiny_dims, rank=4, seed=3)
    a, b = store.put_version(hostile), store.put_version(clean)
    assert a.sha256 == b.sha256 and a.uri != b.uri
    assert "auto_mapping" in json.loads(store.read_bytes(a.uri + "/adapter_config.json", max_bytes=1 << 20))
    assert "auto_mapping" not in json.loads(store.read_bytes(b.uri + "/adapter_config.json", max_bytes=1 << 20))


def test_a_different_alpha_is_a_different_object(tmp_path, tiny_dims):
    store = ObjectStore(str(tmp_path / "objects"))
    a = write_adapter(tmp_path / "a", tiny_dims, rank=4, seed=1)
    b = write_adapter(tmp_path / "b", tiny_dims, rank=4, seed=1, alpha=32)
    assert store.put_version(a).sha256 != store.put_version(b).sha256


def test_objects_are_never_overwritten_with_other_bytes(tmp_path):
    store = ObjectStore(str(tmp_path / "objects"))
    blob = tmp_path / "eval.jsonl"
    blob.write_text('{"prompt": "a", "expected": "b"}\n')
    stored = store.put_blob(blob, "evalsets", ".jsonl")
    assert stored.sha256 == file_sha256(blob)
    target = tmp_path / "objects" / "evalsets" / f"{stored.sha256}.jsonl"
    # Someone corrupts the stored object: storing the original again refuses instead of silently "fixing" it.
    target.write_text("tampered")
    with pytest.raises(StorageError):
        store.put_blob(blob, "evalsets", ".jsonl")
    assert target.read_text() == "tampered"


def test_uris_outside_the_store_are_refused(tmp_path):
    store = ObjectStore(str(tmp_path / "objects"))
    for uri in ("file:///etc/passwd", f"file://{tmp_path}/objects/../secret", "s3://other/adapters/x"):
        with pytest.raises(StorageError):
            store.fetch(uri, tmp_path / "out")


def test_any_fsspec_filesystem_works(tmp_path, tiny_dims):
    """The same interface over fsspec's in-memory filesystem (what S3 looks like to this code: no rename)."""
    store = ObjectStore("memory://mplex-test-objects")
    adapter = write_adapter(tmp_path / "a", tiny_dims, rank=4)
    stored = store.put_version(adapter)
    assert stored.uri.startswith("memory://mplex-test-objects/adapters/")
    assert content_id(store.fetch(stored.uri, tmp_path / "back")) == stored.sha256
    assert json.loads(store.read_bytes(stored.uri + "/adapter_config.json", max_bytes=1 << 20))["r"] == 4


def test_the_engine_loads_a_stored_version_by_content_id(tmp_path, tiny_base, tiny_dims):
    """Engines are handed (content id, storage_uri): both local paths and fsspec URLs load and check the id."""
    from services.engine.config import ModelConfig
    from services.engine.lora.manager import AdapterManager
    from services.engine.config import LoraConfig
    from services.engine.sequence import AdapterRef

    adapter = write_adapter(tmp_path / "a", tiny_dims, rank=4, targets=("q_proj", "down_proj"))
    for url in (f"file://{tmp_path / 'objects'}", "memory://mplex-engine-objects"):
        stored = ObjectStore(url).put_version(adapter)
        cache = tmp_path / f"cache-{len(url)}"
        cache.mkdir()  # the engine expects its adapter cache directory to exist
        manager = AdapterManager(ModelConfig.from_dir(tiny_base), LoraConfig(max_loras=2, max_cpu_loras=2),
                                 dtype=torch.float32, device="cpu", cache_dir=cache)
        weights = manager.load_sync(AdapterRef(stored.sha256, "a", stored.uri))
        assert weights.content_id == stored.sha256
        assert weights.target_modules == ["q_proj", "down_proj"]
        manager.shutdown()
