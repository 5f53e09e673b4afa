"""The malicious-upload corpus: one hostile or broken upload per kind, each with the refusal code it must get.

Every case is a file as a client would upload it (an archive), built from a good adapter for the tiny
base model and then broken in exactly one way. Escape attempts aim at marker paths (`escape_targets`)
that must not exist after the corpus has been processed.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import struct
import tarfile
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import save

from services.common.lora_format import BaseDims
from tests.adapters.tinymodel import lora_tensors, tensor_name

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class Case:
    kind: str
    code: str  # the refusal code it must get
    filename: str  # what the client calls the upload
    data: bytes


def good_config(rank: int = 4, targets=("q_proj", "v_proj"), **extra) -> dict:
    return {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none",
            "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "use_dora": False, **extra}


def good_weights(dims: BaseDims, rank: int = 4, targets=("q_proj", "v_proj"), **kw) -> bytes:
    return save(lora_tensors(dims, rank=rank, targets=targets, **kw), metadata={"format": "pt"})


def raw_safetensors(header: dict, data: bytes, header_len: int | None = None) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) if header_len is None else header_len) + h + data


def tar_gz(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def reg(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode = 0o644
    return info


def adapter_tar(config: dict | bytes, weights: bytes, extra: list[tuple[tarfile.TarInfo, bytes | None]] = ()) -> bytes:
    cfg = config if isinstance(config, bytes) else json.dumps(config).encode()
    return tar_gz([(reg(CONFIG), cfg), (reg(WEIGHTS), weights), *extra])


def zip_bytes(entries: list[tuple[str, bytes]], *, compression=zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compression) as zf:
        for name, data in entries:
            zf.writestr(name, data)
    return buf.getvalue()


def escape_targets(tag: str) -> dict[str, str]:
    """Absolute paths escape attempts aim at (unique per corpus run)."""
    return {"traversal_tar": f"/tmp/mplex-escape-{tag}-tar.txt", "traversal_zip": f"/tmp/mplex-escape-{tag}-zip.txt",
            "absolute": f"/tmp/mplex-escape-{tag}-abs.txt", "symlink": f"/tmp/mplex-escape-{tag}-link"}


def build_corpus(dims: BaseDims, *, max_rank: int = 64, tag: str | None = None) -> tuple[list[Case], dict[str, str]]:
    tag = tag or uuid.uuid4().hex[:8]
    targets = escape_targets(tag)
    cfg, w = good_config(), good_weights(dims)
    up = "../" * 24  # more levels than any sandbox is deep: a naive extractor would write under /
    cases: list[Case] = []

    def add(kind: str, code: str, data: bytes, filename: str = "adapter.tar.gz") -> None:
        cases.append(Case(kind, code, filename, data))

    # -- files that are code or pickles
    add("pickle_bin", "pickle_file", tar_gz([(reg(CONFIG), json.dumps(cfg).encode()),
                                              (reg("adapter_model.bin"), pickle.dumps({"w": [1, 2, 3]}))]))
    add("pickle_disguised", "pickle_file", adapter_tar(cfg, pickle.dumps(torch.zeros(2).tolist(), protocol=4)))
    add("torch_save_zip", "pickle_file", adapter_tar(cfg, _torch_save_bytes()))
    add("code_file_py", "code_file", adapter_tar(cfg, w, [(reg("setup.py"), b"import os\nos.system('id')\n")]))
    add("shared_library", "code_file", adapter_tar(cfg, w, [(reg("libevil.so"), b"\x7fELF" + b"\x00" * 60)]))
    add("executable_disguised", "code_file", adapter_tar(cfg, b"#!/bin/sh\nrm -rf /\n"))
    add("auto_map", "custom_code", adapter_tar(good_config(auto_map={"AutoModel": "evil.EvilModel"}), w))
    add("trust_remote_code", "custom_code", adapter_tar(good_config(trust_remote_code=True), w))
    add("auto_mapping_foreign_library", "custom_code",
        adapter_tar(good_config(auto_mapping={"base_model_class": "Evil", "parent_library": "os"}), w))
    # -- archive structure
    add("zip_slip", "archive_path_traversal",
        zip_bytes([(CONFIG, json.dumps(cfg).encode()), (WEIGHTS, w), (up + targets["traversal_zip"].lstrip("/"), b"pwned")]),
        "adapter.zip")
    add("tar_traversal", "archive_path_traversal",
        adapter_tar(cfg, w, [(reg(up + targets["traversal_tar"].lstrip("/")), b"pwned")]))
    add("absolute_path", "archive_path_absolute", adapter_tar(cfg, w, [(reg(targets["absolute"]), b"pwned")]))
    link = reg(WEIGHTS)
    link.type, link.linkname = tarfile.SYMTYPE, targets["symlink"]
    add("symlink", "archive_symlink", tar_gz([(reg(CONFIG), json.dumps(cfg).encode()), (link, None)]))
    hard = reg("extra.json")
    hard.type, hard.linkname = tarfile.LNKTYPE, "/etc/passwd"
    add("hardlink", "archive_hardlink", adapter_tar(cfg, w, [(hard, None)]))
    dev = reg("random.json")
    dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 1, 8
    add("device_file", "archive_special_file", adapter_tar(cfg, w, [(dev, None)]))
    fifo = reg("pipe.json")
    fifo.type = tarfile.FIFOTYPE
    add("fifo", "archive_special_file", adapter_tar(cfg, w, [(fifo, None)]))
    add("zip_bomb", "archive_compression_ratio",
        zip_bytes([(CONFIG, json.dumps(cfg).encode()), (WEIGHTS, b"\x00" * (64 << 20))]), "adapter.zip")
    add("gzip_bomb", "archive_compression_ratio", tar_gz([(reg(CONFIG), json.dumps(cfg).encode()),
                                                          (reg(WEIGHTS), b"\x00" * (64 << 20))]))
    add("too_many_files", "archive_too_many_files",
        zip_bytes([(CONFIG, json.dumps(cfg).encode()), (WEIGHTS, w)] + [(f"notes/{i}.txt", b"x") for i in range(100)]),
        "adapter.zip")
    add("empty_archive", "archive_empty", tar_gz([]))
    add("empty_zip", "archive_empty", zip_bytes([]), "adapter.zip")
    add("not_an_archive", "unsupported_upload", os.urandom(4096), "adapter.tar.gz")
    # a gzip stream whose first match points before the start (zlib.error, not OSError), and a zip that asks
    # for a newer format than Python reads (NotImplementedError): both once escaped as server errors
    add("corrupt_deflate", "archive_unreadable", b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + b"\x03\x02\x00" + b"\x00" * 8)
    add("zip_unsupported_version", "archive_unreadable", _zip_version(zip_bytes([(CONFIG, json.dumps(cfg).encode()), (WEIGHTS, w)]), 201),
        "adapter.zip")
    add("missing_weights", "missing_file", tar_gz([(reg(CONFIG), json.dumps(cfg).encode())]))
    add("two_adapters", "duplicate_file", adapter_tar(cfg, w, [(reg("other/" + WEIGHTS), w)]))
    # -- config
    add("bad_json_config", "bad_config", adapter_tar(b"{not json", w))
    add("dora", "dora_unsupported", adapter_tar(good_config(use_dora=True), w))
    add("modules_to_save", "modules_to_save_unsupported", adapter_tar(good_config(modules_to_save=["lm_head"]), w))
    add("bias", "bias_unsupported", adapter_tar(good_config(bias="all"), w))
    add("unknown_target_module", "unknown_target_module", adapter_tar(good_config(targets=("q_proj", "foo_proj")), w))
    add("embedding_lora", "embedding_lora_unsupported", adapter_tar(good_config(targets=("lm_head",)), w))
    big = max_rank * 2
    add("rank_over_max", "rank_over_max", adapter_tar(good_config(rank=big), good_weights(dims, rank=big)))
    add("wrong_base_name", "base_model_mismatch", adapter_tar(good_config(base_model_name_or_path="meta-llama/Llama-2-70b-hf"), w))
    # -- safetensors header and tensors
    add("oversize_header", "oversize_header", adapter_tar(cfg, raw_safetensors({}, b"\x00" * 64, header_len=1 << 40)))
    a, b = tensor_name(0, "q_proj", "A"), tensor_name(0, "q_proj", "B")
    d_q = dims.num_heads * dims.head_dim
    overlap = raw_safetensors({a: {"dtype": "F32", "shape": [4, dims.hidden_size], "data_offsets": [0, 16 * dims.hidden_size]},
                               b: {"dtype": "F32", "shape": [d_q, 4], "data_offsets": [8, 8 + 16 * d_q]}},
                              b"\x00" * (16 * dims.hidden_size + 16 * d_q))
    add("overlapping_offsets", "overlapping_offsets", adapter_tar(cfg, overlap))
    mismatch = raw_safetensors({a: {"dtype": "F32", "shape": [4, dims.hidden_size], "data_offsets": [0, 8 * dims.hidden_size]}},
                               b"\x00" * (8 * dims.hidden_size))
    add("dtype_shape_mismatch", "dtype_shape_mismatch", adapter_tar(cfg, mismatch))
    outside = raw_safetensors({a: {"dtype": "F32", "shape": [4, dims.hidden_size], "data_offsets": [64, 64 + 16 * dims.hidden_size]}},
                              b"\x00" * 16)
    add("offsets_out_of_range", "bad_offsets", adapter_tar(cfg, outside))
    hidden = raw_safetensors({a: {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}}, b"\x00" * 4 + b"SECRETPAYLOAD")
    add("hidden_trailing_bytes", "bad_offsets", adapter_tar(cfg, hidden))
    add("empty_adapter", "empty_adapter", adapter_tar(cfg, save({}, metadata={"format": "pt"})))
    wrong = BaseDims(dims.hidden_size * 2, dims.intermediate_size, dims.num_layers, dims.num_heads, dims.num_kv_heads, dims.head_dim * 2)
    add("wrong_base_dims", "shape_mismatch", adapter_tar(cfg, good_weights(wrong)))
    add("rank_mismatch", "rank_mismatch", adapter_tar(good_config(rank=8), w))
    add("unexpected_layer", "shape_mismatch", adapter_tar(cfg, save({**lora_tensors(dims, rank=4, targets=("q_proj", "v_proj")),
                                                                    **_layer_tensors(dims, dims.num_layers + 3)},
                                                                   metadata={"format": "pt"})))
    t = lora_tensors(dims, rank=4, targets=("q_proj", "v_proj"))
    del t[tensor_name(0, "v_proj", "B")]
    add("missing_tensor_pair", "missing_tensor", adapter_tar(cfg, save(t, metadata={"format": "pt"})))
    t = lora_tensors(dims, rank=4, targets=("q_proj", "v_proj"))
    t[tensor_name(1, "q_proj", "B")][3, 1] = float("nan")
    add("nan_weights", "nan_weights", adapter_tar(cfg, save(t, metadata={"format": "pt"})))
    t = lora_tensors(dims, rank=4, targets=("q_proj", "v_proj"), dtype=torch.bfloat16)
    t[tensor_name(0, "v_proj", "A")][0, 0] = float("inf")
    add("inf_weights_bf16", "nan_weights", adapter_tar(cfg, save(t, metadata={"format": "pt"})))
    t = lora_tensors(dims, rank=4, targets=("q_proj", "v_proj"))
    t[tensor_name(0, "q_proj", "A")] = t[tensor_name(0, "q_proj", "A")].to(torch.int32)
    add("integer_tensor", "bad_dtype", adapter_tar(cfg, save(t, metadata={"format": "pt"})))
    add("tensor_for_untargeted_module", "unexpected_tensor",
        adapter_tar(good_config(targets=("q_proj",)), w))
    return cases, targets


def _layer_tensors(dims: BaseDims, layer: int) -> dict[str, torch.Tensor]:
    return {tensor_name(layer, "q_proj", "A"): torch.zeros(4, dims.hidden_size),
            tensor_name(layer, "q_proj", "B"): torch.zeros(dims.num_heads * dims.head_dim, 4)}


def _zip_version(data: bytes, version: int) -> bytes:
    """The zip with every central-directory entry's 'version needed to extract' set to `version`."""
    out = bytearray(data)
    i = out.find(b"PK\x01\x02")
    while i != -1:
        out[i + 6:i + 8] = struct.pack("<H", version)
        i = out.find(b"PK\x01\x02", i + 4)
    return bytes(out)


def _torch_save_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buf)
    return buf.getvalue()


Builder = Callable[[BaseDims], tuple[list[Case], dict[str, str]]]
