"""The content-addressed object store for adapter files, behind one fsspec interface (a local directory by
default — `file://<home>/objects` —, S3 or any fsspec URL in production: settings `storage_url`).

Layout under the root:
    adapters/<files_sha256>/adapter_config.json      a version's two files, keyed by the sha256 of their exact
    adapters/<files_sha256>/adapter_model.safetensors  bytes (`files_sha256`)
    uploads/<sha256>.<kind>                          an upload that could not be unpacked (kept for its rejection)
    evalsets/<sha256>.jsonl                          tenants' eval sets
    batches/<sha256>.jsonl                           Batch API files: inputs, outputs, error files (services.batch;
                                                     the batch_files rows own them, not the adapter retention)
    batches/parts/<batch>/<seq>.jsonl                a running batch's results, written as lines finish (the one
                                                     mutable kind: a part is rewritten until its row commits)

Objects are immutable: a key is written once (to a temporary name, then renamed where the filesystem can)
and never overwritten with different bytes. Engines read a version's prefix directly (local paths) or copy
it once into their cache (remote URLs), and identify what they load by its content id.

Objects are shared: two versions (of one tenant or of two) with the same bytes have the same key. Whether an
object may be removed is therefore decided by the database (which versions still reference it), never by
its path: services.adapters.retention lists and deletes through this class.

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


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object as listed: a version's prefix (its files together) or a blob."""

    uri: str
    size_bytes: int
    modified: float  # UNIX time of its newest file


TMP_PREFIX = ".tmp-"  # a write in progress (or one whose writer died before its rename)


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
    def plan_version(self, adapter_dir: Path) -> StoredObject:
        """Where `put_version` would store these files, and how many bytes they take (nothing is written)."""
        adapter_dir = Path(adapter_dir)
        size = sum((adapter_dir / name).stat().st_size for name in ADAPTER_FILES)
        return StoredObject(content_id(adapter_dir), self.uri(f"adapters/{files_sha256(adapter_dir)}"), int(size))

    def put_version(self, adapter_dir: Path, planned: StoredObject | None = None) -> StoredObject:
        """Store an adapter's two files under the hash of their bytes; returns its content id and URI.
        Storing the same files again is a no-op. `planned`: `plan_version`'s answer for these files (saves
        hashing them twice)."""
        adapter_dir = Path(adapter_dir)
        planned = planned or self.plan_version(adapter_dir)
        prefix = self.key_of(planned.uri)
        for name in ADAPTER_FILES:
            self._put_immutable(adapter_dir / name, f"{prefix}/{name}")
        return planned

    def plan_blob(self, path: Path, kind: str, suffix: str = "") -> StoredObject:
        """Where `put_blob` would store this file (nothing is written)."""
        if kind not in ("uploads", "evalsets", "batches"):
            raise ValueError(f"unknown blob kind {kind!r}")
        sha = file_sha256(path)
        return StoredObject(sha, self.uri(f"{kind}/{sha}{suffix}"), Path(path).stat().st_size)

    def put_blob(self, path: Path, kind: str, suffix: str = "", planned: StoredObject | None = None) -> StoredObject:
        """Store a file under `<kind>/<sha256><suffix>` (uploads, eval sets); `planned` as in put_version."""
        planned = planned or self.plan_blob(path, kind, suffix)
        self._put_immutable(Path(path), self.key_of(planned.uri))
        return planned

    def put_part(self, path: Path, key: str) -> StoredObject:
        """Write a batch result part under `key` (batches/parts/...), replacing what a writer that died before
        recording it left there; services.batch.parts runs one writer per batch (its runner lock)."""
        if not key.startswith("batches/parts/"):
            raise ValueError(f"{key!r} is not a batch part key")
        self._publish(path, self._path(key))
        return StoredObject(file_sha256(path), self.uri(key), Path(path).stat().st_size)

    def delete_parts(self, prefix: str) -> int:
        """Remove a batch's part objects (everything under `prefix`, a batches/parts/<batch> key); returns the
        bytes freed. Removing what is already gone is a no-op."""
        if not prefix.startswith("batches/parts/") or ".." in prefix.split("/"):
            raise ValueError(f"{prefix!r} is not a batch parts prefix")
        path = self._path(prefix.rstrip("/"))
        try:
            names = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return 0
        freed = sum(self._rm(p) for p in names)
        if self.local:
            try:
                os.rmdir(path)
            except (FileNotFoundError, OSError):
                pass
        return freed

    def _put_immutable(self, local: Path, key: str) -> None:
        target = self._path(key)
        if self.fs.exists(target):
            if self._sha(target) != file_sha256(local):
                raise StorageError(f"object {key} already exists with different bytes; objects are immutable")
            return
        self._publish(local, target)

    def _publish(self, local: Path, target: str) -> None:
        parent = target.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if self.local:
            # A private temporary name then an atomic rename: readers never see a partial object, and two
            # writers of the same content both end with the right bytes.
            tmp = f"{parent}/{TMP_PREFIX}{uuid.uuid4().hex}"
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

    def copy_to(self, uri: str, out) -> int:
        """Append a blob's bytes to the open binary file `out`, in chunks; returns the bytes copied."""
        n = 0
        with self.fs.open(self._path(self.key_of(uri)), "rb") as f:
            while chunk := f.read(1 << 20):
                out.write(chunk)
                n += len(chunk)
        return n

    def read_bytes(self, uri: str, *, max_bytes: int) -> bytes:
        path = self._path(self.key_of(uri))
        if self.fs.size(path) > max_bytes:
            raise StorageError(f"{uri} is larger than {max_bytes} bytes")
        with self.fs.open(path, "rb") as f:
            return f.read()

    # -- listing and removal (services.adapters.retention decides what may go) --------------------------------
    def list_objects(self) -> list[ObjectInfo]:
        """Every stored object: version prefixes (adapters/<key>, their files summed) and blobs. Writes in
        progress (temporary names) are not objects; `list_temporary` lists them."""
        versions: dict[str, list[tuple[int, float]]] = {}
        out = []
        for path, info in self._files():
            key = path[len(self.root) + 1:]
            parts = key.split("/")
            if parts[-1].startswith(TMP_PREFIX):
                continue
            if parts[0] == "adapters" and len(parts) == 3:
                versions.setdefault(f"adapters/{parts[1]}", []).append((int(info.get("size") or 0), _mtime(info)))
            elif parts[0] in ("uploads", "evalsets") and len(parts) == 2:
                out.append(ObjectInfo(self.uri(key), int(info.get("size") or 0), _mtime(info)))
        out.extend(ObjectInfo(self.uri(prefix), sum(s for s, _ in files), max(m for _, m in files))
                   for prefix, files in versions.items())
        return out

    def list_temporary(self) -> list[ObjectInfo]:
        """Temporary files of writes in progress, or of writers that died before their rename."""
        return [ObjectInfo(f"{self.url}/{path[len(self.root) + 1:]}", int(info.get("size") or 0), _mtime(info))
                for path, info in self._files() if path.rsplit("/", 1)[-1].startswith(TMP_PREFIX)]

    def delete(self, uri: str) -> int:
        """Remove an object (a version prefix with its files, or a blob, or a temporary file); returns the
        bytes freed. Removing what is already gone is a no-op (returns 0)."""
        key = self.key_of(uri)
        path = self._path(key)
        freed = 0
        if key.startswith("adapters/") and len(key.split("/")) == 2:
            for name in [*ADAPTER_FILES, *self._children(path)]:
                freed += self._rm(f"{path}/{name}")
            if self.local:  # object stores have no directories to remove
                try:
                    os.rmdir(path)
                except FileNotFoundError:
                    pass
            return freed
        return self._rm(path)

    def _children(self, path: str) -> list[str]:
        try:
            return [p.rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False)
                    if p.rsplit("/", 1)[-1] not in ADAPTER_FILES]
        except FileNotFoundError:
            return []

    def _rm(self, path: str) -> int:
        try:
            size = int(self.fs.size(path) or 0)
            self.fs.rm_file(path)
            return size
        except FileNotFoundError:
            return 0

    def _files(self):
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return []
        return [(path.rstrip("/"), info) for path, info in found.items() if info.get("type") == "file"]


def _mtime(info: dict) -> float:
    """Last-modified time from an fsspec listing (local: mtime; S3: LastModified; memory: created)."""
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        return float(value)
    return 0.0
