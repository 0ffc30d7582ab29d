"""Which steps the fused decode call takes (model/fused_decode.py `handles`): decode rows only, up to
the limit of the kernel that runs the linears, the same answer whether or not a step asks the kernel
(steps under both kernels' limits, batch-1 decode among them, do not)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model import fused_decode
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.fused_decode import FusedDecodeStack
from tokenmill.model.layers.quantized_linear import AVX2_DENSE_MIN_ROWS


def meta(decode_rows: int, prompt_rows: int = 0, lens: bool = True) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=torch.zeros(decode_rows + prompt_rows, dtype=torch.long),
                             num_decode=decode_rows, page_size=16, decode_block_table=None, decode_mask=None,
                             prefills=[], decode_seq_lens=torch.ones(decode_rows, dtype=torch.long) if lens else None)


@pytest.mark.parametrize("blocked", ["vnni", "avx2"])
def test_decode_steps_up_to_the_kernels_limit(blocked, monkeypatch):
    monkeypatch.setattr(fused_decode.quant_kernel, "blocked_kernel", lambda: blocked)
    limit = FusedDecodeStack.max_rows()
    assert limit == (FusedDecodeStack.MAX_ROWS if blocked == "vnni" else AVX2_DENSE_MIN_ROWS - 1)
    for rows in (1, 2, AVX2_DENSE_MIN_ROWS - 1, AVX2_DENSE_MIN_ROWS, limit, limit + 1, 4 * limit):
        assert FusedDecodeStack.handles(rows, meta(rows)) == (rows <= limit), rows
    assert not FusedDecodeStack.handles(0, meta(0))
    assert not FusedDecodeStack.handles(5, meta(4, prompt_rows=1))  # a prompt row in the step
    assert not FusedDecodeStack.handles(4, meta(4, lens=False))  # no lengths: not the paged kernel's step


def test_small_steps_do_not_ask_which_kernel_runs(monkeypatch):
    def asked():
        raise AssertionError("max_rows() asked for a step every kernel takes")

    monkeypatch.setattr(FusedDecodeStack, "max_rows", classmethod(lambda cls: asked()))
    assert FusedDecodeStack.handles(1, meta(1))
    assert FusedDecodeStack.handles(AVX2_DENSE_MIN_ROWS - 1, meta(AVX2_DENSE_MIN_ROWS - 1))
    with pytest.raises(AssertionError, match="asked"):
        FusedDecodeStack.handles(AVX2_DENSE_MIN_ROWS, meta(AVX2_DENSE_MIN_ROWS))
