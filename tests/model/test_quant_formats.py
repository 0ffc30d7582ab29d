"""The GGUF format registry and the exact dequantization of every type: bit for bit gguf-py's, also
through row and column slices, stacking and the slab loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import _type_traits
from gguf.quants import dequantize as gguf_dequantize

from tests.gguf_blocks import random_blocks
from tokenmill.model import quant
from tokenmill.model.quant_formats import FORMATS, GGUFWeight, dequantize_rows, format_of
from tokenmill.model.quant_formats import dequantize as dequantize_module
from tokenmill.model.quant_formats.gguf_weight import drop_file_pages

QUANTIZED = sorted(name for name, f in FORMATS.items()
                   if f.quantized and any(t.name == name for t in _type_traits))


def bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def test_registry_describes_the_block_layouts():
    assert (format_of("Q4_K").block_elems, format_of("Q4_K").block_bytes) == (256, 144)
    assert format_of("Q4_K").bits_per_weight == 4.5 and format_of("Q8_0").bits_per_weight == 8.5
    assert format_of("IQ4_XS").kernel and not format_of("IQ2_XXS").kernel and not format_of("F16").quantized
    assert format_of("Q6_K").row_bytes(512) == 420
    with pytest.raises(ValueError, match="576 weights is not a whole number of Q4_K blocks"):
        format_of("Q4_K").row_bytes(576)
    with pytest.raises(ValueError, match="unknown GGUF tensor type"):
        format_of("Q9_9")


def test_registry_agrees_with_the_kernels():
    declared = {name for name, f in FORMATS.items() if f.kernel}
    if not hasattr(quant, "KERNEL_TYPES"):
        pytest.skip("this build's kernels predate KERNEL_TYPES")
    assert set(quant.KERNEL_TYPES) == declared


@pytest.mark.parametrize("kind", QUANTIZED)
def test_dequantization_is_gguf_py_bit_for_bit(kind, monkeypatch):
    rows, cols = 7, 2 * format_of(kind).block_elems * (2 if format_of(kind).block_elems < 256 else 1)
    raw = random_blocks(kind, rows, cols, seed=len(kind))
    theirs = gguf_dequantize(raw, _gguf_type(kind)).reshape(rows, cols)
    assert np.isfinite(theirs).all()
    monkeypatch.setattr(dequantize_module, "_SLAB_WEIGHTS", 2 * cols)  # several slabs, a short last one
    ours = dequantize_rows(kind, raw, cols)
    assert ours.dtype == torch.float32 and np.array_equal(bits(ours), bits(theirs))
    assert torch.equal(dequantize_rows(kind, raw, cols, torch.bfloat16), ours.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_unquantized_rows_too(kind):
    values = torch.randn(3, 8)
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
    raw = values.to(dtype).view(torch.uint8).numpy()
    assert torch.equal(dequantize_rows(kind, raw, 8), values.to(dtype).float())


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_0", "IQ4_XS", "IQ2_XXS"])
def test_row_and_column_operations_move_whole_blocks(kind):
    b = format_of(kind).block_elems
    n, k = 6, 4 * b
    w = GGUFWeight(kind, random_blocks(kind, n, k, seed=3), (n, k))
    dense = w.dequantize()
    order = torch.tensor([5, 0, 3, 1, 4, 2])
    assert torch.equal(w.rows(order).dequantize(), dense[order])
    assert torch.equal(w.row_slice(2, 5).dequantize(), dense[2:5])
    assert torch.equal(w.column_slice(b, 3 * b).dequantize(), dense[:, b : 3 * b])
    assert torch.equal(GGUFWeight.cat([w.row_slice(0, 2), w]).dequantize(), torch.cat([dense[:2], dense]))
    with pytest.raises(ValueError, match=f"cut {kind} blocks of {b} weights"):
        w.column_slice(0, b + 16)
    assert w.blocks().shape == (n, format_of(kind).row_bytes(k)) and w.nbytes == w.raw.nbytes


def test_shape_must_match_the_bytes():
    with pytest.raises(ValueError, match=r"Q4_K \[2, 256\] needs 2 rows of 144 bytes"):
        GGUFWeight("Q4_K", np.zeros((2, 100), np.uint8), (2, 256))
    with pytest.raises(ValueError, match="one GGUF type"):
        GGUFWeight.cat([GGUFWeight("Q4_0", np.zeros((1, 18), np.uint8), (1, 32)),
                        GGUFWeight("Q8_0", np.zeros((1, 34), np.uint8), (1, 32))])


def test_released_file_pages_read_back_the_same(tmp_path):
    raw = random_blocks("Q6_K", 64, 512, seed=1)
    path = tmp_path / "blocks.bin"
    raw.tofile(path)
    mapped = np.memmap(path, mode="r").reshape(raw.shape)
    w = GGUFWeight("Q6_K", mapped, (64, 512))
    before = w.dequantize()
    w.release()
    drop_file_pages(raw)  # not a map: nothing happens
    assert torch.equal(w.dequantize(), before)


def _gguf_type(kind: str):
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType[kind]


# ---- types newer than the gguf package (quant_formats/newer_types.py) -------------------------------

def ggml_reference(kind: str, raw: np.ndarray) -> np.ndarray:
    """ggml-quants.c's dequantize_row_q1_0 / q2_0, element by element as the C loops write them."""
    size, qk = {"Q1_0": (18, 128), "Q2_0": (18, 64)}[kind]
    blocks = raw.reshape(-1, size)
    out = np.empty(len(blocks) * qk, np.float32)
    for i, b in enumerate(blocks):
        d = np.float32(b[0:2].view(np.float16)[0])
        for j in range(qk):
            if kind == "Q1_0":
                out[i * qk + j] = d if (b[2 + j // 8] >> (j % 8)) & 1 else -d
            else:
                out[i * qk + j] = np.float32(int((b[2 + j // 4] >> (2 * (j % 4))) & 3) - 1) * d
    return out


@pytest.mark.parametrize("kind", ["Q1_0", "Q2_0"])
def test_newer_types_dequantize_as_ggml_does(kind):
    block = format_of(kind).block_elems
    raw = random_blocks(kind, 3, 2 * block, seed=11)
    raw[0, 0:2] = np.array([0.0], np.float16).view(np.uint8)  # d = +0: ggml's -d is -0.0
    raw[1, 18:20] = np.array([-0.0], np.float16).view(np.uint8)
    theirs = ggml_reference(kind, raw).reshape(3, 2 * block)
    ours = dequantize_rows(kind, raw, 2 * block)
    assert np.array_equal(bits(ours), bits(theirs))
    assert format_of(kind).block_bytes == 18 and format_of(kind).row_bytes(2 * block) == 36


def test_a_tensor_type_nobody_knows_is_named_not_called_corrupt(tmp_path):
    import gguf

    from tokenmill.errors import ModelLoadError
    from tokenmill.model.gguf_loader import load_gguf

    path = tmp_path / "future.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    # int8 bytes keep the shape as given: gguf-py cannot size a type it does not know
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, 18), np.int8), raw_shape=(2, 32), raw_dtype=250)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"unsupported tensor type: tensor 'blk.0.attn_q.weight': GGML "
                                             r"tensor type 250 is unknown") as e:
        load_gguf(str(path))
    assert "corrupt" not in str(e.value)
