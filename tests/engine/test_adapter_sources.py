"""Where the engine may read adapter files from: inside the object store or its cache, after resolving links."""
from __future__ import annotations

import os

import pytest

from services.common.lora_format import AdapterFormatError
from services.engine.lora.sources import CODE, AdapterSources


@pytest.fixture
def layout(tmp_path):
    store, cache, outside = tmp_path / "objects", tmp_path / "cache", tmp_path / "outside"
    for d in (store / "adapters" / "abc", cache / "f00", outside / "adapter"):
        d.mkdir(parents=True)
    os.symlink(outside / "adapter", store / "adapters" / "link-out")
    os.symlink(store / "adapters" / "abc", store / "adapters" / "link-in")
    return store, cache, outside


def refused(sources: AdapterSources, uri: str, field: str = "path") -> AdapterFormatError:
    with pytest.raises(AdapterFormatError) as info:
        sources.confine(uri, field)
    assert info.value.code == CODE and info.value.field == field
    return info.value


def test_paths_inside_the_store_or_the_cache_are_read_resolved(layout):
    store, cache, _ = layout
    sources = AdapterSources.of([f"file://{store}"], cache)
    inside = store / "adapters" / "abc"
    assert sources.confine(f"file://{inside}", "path") == str(inside.resolve())
    assert sources.confine(str(inside), "path") == str(inside.resolve())
    assert sources.confine(str(store / "adapters" / "link-in"), "path") == str(inside.resolve())
    assert sources.confine(str(cache / "f00"), "path") == str((cache / "f00").resolve())
    assert sources.confine(f"{store}/adapters/x/../abc", "path") == str(inside.resolve())


@pytest.mark.parametrize("uri", [
    "/etc", "/etc/passwd", "file:///tmp/x", "file:///etc", "relative/dir", "", "/bin\0/x",
])
def test_paths_outside_every_store_are_refused(layout, uri):
    store, cache, _ = layout
    refused(AdapterSources.of([f"file://{store}"], cache), uri)


def test_links_and_dot_dots_leading_out_of_the_store_are_refused(layout):
    store, cache, outside = layout
    sources = AdapterSources.of([str(store)], cache)
    refused(sources, str(store / "adapters" / "link-out"))
    refused(sources, f"file://{store / 'adapters' / 'link-out'}", "adapter.uri")
    refused(sources, f"{store}/../outside/adapter")
    refused(sources, f"{store}-evil/adapters/abc")  # a sibling whose name starts like the store


def test_remote_uris_must_be_under_the_store_prefix(layout):
    _, cache, _ = layout
    sources = AdapterSources.of(["s3://bucket/adapters"], cache)
    assert sources.confine("s3://bucket/adapters/adapters/abc", "adapter.uri") == "s3://bucket/adapters/adapters/abc"
    for uri in ("s3://bucket/adapters-evil/abc", "s3://other/adapters/abc", "s3://bucket/adapters/../secrets",
                "s3://bucket/adapters/", "memory://bucket/adapters/abc", "http://169.254.169.254/latest",
                "simplecache::s3://bucket/adapters/abc", "s3://bucket/adapters/abc::http://evil/x"):
        refused(sources, uri, "adapter.uri")
    refused(sources, str(cache / "f00").replace("f00", "../f00"))


def test_no_store_leaves_only_the_cache(layout):
    store, cache, _ = layout
    sources = AdapterSources.of([], cache)
    refused(sources, str(store / "adapters" / "abc"))
    assert sources.confine(str(cache / "f00"), "path") == str((cache / "f00").resolve())
