"""load_lora reads the safetensors bytes itself (one read, views at the header's offsets): it must give what
the safetensors library gives, whatever the file's dtypes and alignment, and name a NaN's module."""
import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from services.common.lora_format import WEIGHTS_FILE, AdapterFormatError, read_config
from services.engine.config import ModelConfig
from services.engine.lora.weights import load_lora

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def rewrite(path, tensors: dict[str, torch.Tensor], header_pad: int) -> None:
    """A safetensors file by hand, its data starting `header_pad` bytes off a 4-byte boundary, so that
    fp32 tensors after it sit at unaligned addresses (the format does not promise alignment)."""
    header, blobs, at = {}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * ((header_pad - (8 + len(raw))) % 4)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


@pytest.fixture()
def adapter(tiny_model, tmp_path):
    from services.modelkit import make_random_adapter

    return make_random_adapter(tiny_model, tmp_path / "a", rank=3, target_modules=["q_proj", "down_proj"],
                               lora_alpha=5, seed=7)


@pytest.mark.parametrize("pad", [0, 1, 2, 3])
def test_mixed_dtypes_at_unaligned_offsets_load_as_the_library_reads_them(tiny_model, adapter, pad):
    original = load_file(str(adapter / WEIGHTS_FILE))
    casts = [torch.float16, torch.float32, torch.bfloat16, torch.float64]
    mixed = {name: t.to(casts[i % len(casts)]) for i, (name, t) in enumerate(sorted(original.items()))}
    rewrite(adapter / WEIGHTS_FILE, mixed, pad)
    model = ModelConfig.from_dir(tiny_model)
    got = load_lora(adapter, model, max_rank=64, dtype=torch.float32)
    lib = load_file(str(adapter / WEIGHTS_FILE))  # the library's reading of the very same file
    cfg = read_config(adapter)
    assert len(got.tensors) == len(lib) // 2
    for name, t in lib.items():
        if ".lora_A." not in name:
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        module = name.split(".lora_A.")[0].rsplit(".", 1)[1]
        a, b = got.tensors[(layer, module)]
        b_lib = lib[name.replace("lora_A", "lora_B")].float() * cfg.scale_for(f"model.layers.{layer}", 3)
        assert torch.equal(a, t.float()) and a.data_ptr() % 4 == 0
        torch.testing.assert_close(b, b_lib, rtol=1e-6, atol=0)


def test_a_nan_is_refused_naming_its_layer_and_module(tiny_model, adapter):
    tensors = load_file(str(adapter / WEIGHTS_FILE))
    name = next(n for n in sorted(tensors) if "layers.1." in n and "down_proj.lora_B" in n)
    tensors[name][0, 0] = float("nan")
    rewrite(adapter / WEIGHTS_FILE, tensors, 0)
    with pytest.raises(AdapterFormatError, match="layer 1 down_proj has NaN"):
        load_lora(adapter, ModelConfig.from_dir(tiny_model), max_rank=64, dtype=torch.float32)


def test_the_content_id_is_the_stores_and_a_changed_byte_is_refused(tiny_model, adapter):
    from services.common.lora_format import content_id

    model = ModelConfig.from_dir(tiny_model)
    cid = content_id(adapter)  # what the adapter store and the gateway name it by
    assert load_lora(adapter, model, max_rank=64, dtype=torch.float32, expected_content_id=cid).content_id == cid
    path = adapter / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit of the last weight
    path.write_bytes(bytes(data))
    with pytest.raises(AdapterFormatError) as info:
        load_lora(adapter, model, max_rank=64, dtype=torch.float32, expected_content_id=cid)
    assert info.value.code == "content_mismatch"
