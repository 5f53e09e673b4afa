"""Where an engine may read adapter files from: inside the configured object store(s) or its own adapter cache.

Paths and URIs that arrive in requests (the internal load endpoint's `path`, the generate call's `adapter.uri`)
pass `AdapterSources.confine` before anything opens them. Local paths are resolved first (symlinks, `..`),
and the resolved path is what gets read, so a link inside a store cannot lead out of it.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from services.common.lora_format import AdapterFormatError

CODE = "adapter_path_not_allowed"


def is_local(uri: str | None) -> bool:
    """A filesystem path or a file:// URL (anything else is an fsspec URL: s3://, memory://, ...)."""
    uri = uri or ""
    return "://" not in uri or uri.startswith("file://")


@dataclass(frozen=True, slots=True)
class AdapterSources:
    local_roots: tuple[Path, ...]  # resolved directories
    url_prefixes: tuple[str, ...]  # remote store URLs, each ending in "/"

    @classmethod
    def of(cls, stores: Iterable[str], cache_dir: Path | None = None) -> AdapterSources:
        """`stores`: object store URLs (settings.storage_url: file://<dir>, s3://bucket/prefix, or a plain
        directory); `cache_dir`: where the engine keeps adapters it copied from remote stores."""
        local, remote = [], []
        for store in stores:
            if is_local(store):
                local.append(Path(store.removeprefix("file://")).resolve())
            else:
                remote.append(store.rstrip("/") + "/")
        if cache_dir is not None:
            local.append(Path(cache_dir).resolve())
        return cls(tuple(local), tuple(remote))

    def confine(self, uri: str, field: str) -> str:
        """What to read for `uri`: its resolved local path, or the remote URI itself. Raises
        AdapterFormatError (a 400 naming `field`) when it is not inside one of the stores."""
        if is_local(uri):
            try:
                path = Path(uri.removeprefix("file://")).resolve()
            except (OSError, ValueError, RuntimeError):  # NUL bytes, symlink loops
                path = None
            if path is not None and path.is_absolute() and any(path.is_relative_to(r) for r in self.local_roots):
                return str(path)
        else:
            rest = next((uri[len(p):] for p in self.url_prefixes if uri.startswith(p)), None)
            # `..` is not special to S3 but may be to other fsspec backends; `::` chains another filesystem in.
            if rest and "::" not in uri and not ({"..", "."} & set(rest.split("/"))):
                return uri
        raise AdapterFormatError(
            CODE, f"{field}: adapter files must be inside the configured object store or the engine's adapter cache",
            field,
        )
