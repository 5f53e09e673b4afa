"""The content-addressed object store for adapter files, behind one fsspec interface (a local directory by
default — `file://<home>/objects` —, S3 or any fsspec URL in production: settings `storage_url`).

Layout under the root:
    adapters/<files_sha256>/adapter_config.json      a version's two files, keyed by the sha256 of their exact
    adapters/<files_sha256>/adapter_model.safetensors  bytes (`files_sha256`)
    uploads/<sha256>.<kind>                          an upload that could not be unpacked (kept for its rejection)
    evalsets/<sha256>.jsonl                          tenants' eval sets

Objects are immutable: a key is written once (to a temporary name, then renamed where the filesystem can)
and never overwritten with different bytes. Engines read a version's prefix directly (local paths) or copy
it once into their cache (remote URLs), and identify what they load by its content id.

Why the key is not the content id: `lora_format.content_id` hashes the weights and only the config fields
that change outputs (the engines' KV and cache identity), so two uploads may share a content id while their
configs differ elsewhere (an `auto_map`, another `base_model_name_or_path`, other `target_modules`).
Each upload must be validated as it was sent, so its files are stored under a key of their exact bytes.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import fsspec

from services.common.lora_format import CONFIG_FILE, WEIGHTS_FILE, content_id

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)


class StorageError(RuntimeError):
    """The object store refused an operation (an immutable object with other bytes, a missing object)."""


@dataclass(frozen=True, slots=True)
class StoredObject:
    sha256: str  # the adapter's content id for versions; the bytes' sha256 for blobs
    uri: str
    size_bytes: int


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def files_sha256(adapter_dir: Path) -> str:
    """The object key of a version: sha256 over the exact bytes of its two files."""
    h = hashlib.sha256(b"mplex-files-v1\0")
    for name in ADAPTER_FILES:
        h.update(file_sha256(Path(adapter_dir) / name).encode())
    return h.hexdigest()


class ObjectStore:
    def __init__(self, url: str):
        if "://" not in url:
            url = f"file://{Path(url).resolve()}"
        self.url = url.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = root.rstrip("/")
        self.local = self.url.startswith("file://")
        if self.local:
            Path(self.root).mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_settings(cls, settings) -> ObjectStore:
        return cls(settings.storage_url)

    # -- keys and URIs ----------------------------------------------------------------------------------------
    def uri(self, key: str) -> str:
        return f"{self.url}/{key}"

    def key_of(self, uri: str) -> str:
        if not uri.startswith(self.url + "/"):
            raise StorageError(f"{uri!r} is not in this object store ({self.url})")
        key = uri[len(self.url) + 1:]
        if ".." in key.split("/") or key.startswith("/"):
            raise StorageError(f"{uri!r} is not a valid object key")
        return key

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    # -- writes ----------------------------------------------------------------------------------------------
    def put_version(self, adapter_dir: Path) -> StoredObject:
        """Store an adapter's two files under the hash of their bytes; returns its content id and URI.
        Storing the same files again is a no-op."""
        adapter_dir = Path(adapter_dir)
        cid = content_id(adapter_dir)
        prefix = f"adapters/{files_sha256(adapter_dir)}"
        for name in ADAPTER_FILES:
            self._put_immutable(adapter_dir / name, f"{prefix}/{name}")
        size = sum(self.fs.size(self._path(f"{prefix}/{name}")) for name in ADAPTER_FILES)
        return StoredObject(cid, self.uri(prefix), int(size))

    def put_blob(self, path: Path, kind: str, suffix: str = "") -> StoredObject:
        """Store a file under `<kind>/<sha256><suffix>` (uploads, eval sets)."""
        if kind not in ("uploads", "evalsets"):
            raise ValueError(f"unknown blob kind {kind!r}")
        sha = file_sha256(path)
        key = f"{kind}/{sha}{suffix}"
        self._put_immutable(Path(path), key)
        return StoredObject(sha, self.uri(key), Path(path).stat().st_size)

    def _put_immutable(self, local: Path, key: str) -> None:
        target = self._path(key)
        if self.fs.exists(target):
            if self._sha(target) != file_sha256(local):
                raise StorageError(f"object {key} already exists with different bytes; objects are immutable")
            return
        parent = target.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if self.local:
            # A private temporary name then an atomic rename: readers never see a partial object, and two
            # writers of the same content both end with the right bytes.
            tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
            self.fs.put_file(str(local), tmp)
            os.replace(tmp, target)
        else:
            self.fs.put_file(str(local), target)  # object stores publish a PUT atomically

    def _sha(self, path: str) -> str:
        h = hashlib.sha256()
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return h.hexdigest()

    # -- reads -----------------------------------------------------------------------------------------------
    def exists(self, uri: str) -> bool:
        return self.fs.exists(self._path(self.key_of(uri)))

    def fetch(self, uri: str, dest: Path) -> Path:
        """Copy an object into `dest`: a version prefix (adapters/<id>) becomes a directory with its two
        files; a blob becomes the file `dest`. Returns the local path."""
        key = self.key_of(uri)
        dest = Path(dest)
        if key.startswith("adapters/"):
            dest.mkdir(parents=True, exist_ok=True)
            for name in ADAPTER_FILES:
                src = self._path(f"{key}/{name}")
                if not self.fs.exists(src):
                    raise StorageError(f"{uri}/{name} is missing from the object store")
                self.fs.get_file(src, str(dest / name))
            return dest
        src = self._path(key)
        if not self.fs.exists(src):
            raise StorageError(f"{uri} is missing from the object store")
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(src, str(dest))
        return dest

    def read_bytes(self, uri: str, *, max_bytes: int) -> bytes:
        path = self._path(self.key_of(uri))
        if self.fs.size(path) > max_bytes:
            raise StorageError(f"{uri} is larger than {max_bytes} bytes")
        with self.fs.open(path, "rb") as f:
            return f.read()
