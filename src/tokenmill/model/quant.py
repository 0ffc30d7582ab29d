"""Weights that stay quantized in memory: the one packed format the CPU kernel reads, and conversions.

A `QuantizedWeight` is an [N, K] matrix stored in groups of 32 along K: integer codes (4 or 8 bits)
and per-group fp16 `scales` and optional `mins`, value = scale * code + min. GGUF's Q4_0, Q4_1 and
Q8_0 map onto it without changing a value (their blocks are 32 wide with fp16 scales), so a GGUF
model is read once and kept at about its file size; `dequantize()` reproduces the fp32 values the
`gguf` package gives, bit for bit, for the exact path. Hugging Face weights can be quantized into it
at load (`quantize_int8`, `quantize_int4`, vLLM's `--quantization` names).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.model.blocked_formats import FORMATS, BlockedWeight, blocked_from_file, by_row_chunks

__all__ = ["KERNEL_TYPES", "BlockedWeight", "QuantizedWeight", "to_blocked", "to_blocked_gguf"]

GROUP = 32
# GGUF types read into the packed format as they are (block layout, then the bits it becomes).
NATIVE_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")
# GGUF types the VNNI kernels read in their own blocks (model/blocked_formats.py), kept quantized.
KERNEL_TYPES: frozenset[str] = frozenset(FORMATS)


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # int4: uint8 [N, K / 2] (nibble order of GGUF Q4 blocks); int8: int8 [N, K]
    scales: torch.Tensor  # float16 [N, K / 32]
    mins: torch.Tensor | None  # float16 [N, K / 32], or None for symmetric formats
    bits: int
    kind: str  # where the numbers came from: a GGUF type name ("Q4_1") or "int8" / "int4"

    @property
    def shape(self) -> tuple[int, int]:
        n = self.codes.shape[0]
        return (n, self.codes.shape[1] * (2 if self.bits == 4 else 1))

    @property
    def nbytes(self) -> int:
        total = self.codes.nbytes + self.scales.nbytes
        return total + (self.mins.nbytes if self.mins is not None else 0)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] matrix. In fp32 the operations are gguf's own (scale * code, then + min,
        each rounded once), so the exact path sees the same numbers as when it dequantized with gguf."""
        n, k = self.shape
        codes = self._codes_by_group().float()  # [N, G, 32]
        out = codes * self.scales.float().unsqueeze(-1)
        if self.mins is not None:
            out = out + self.mins.float().unsqueeze(-1)
        return out.reshape(n, k).to(dtype)

    def rows(self, ids: torch.Tensor) -> QuantizedWeight:
        """The rows `ids` (an embedding lookup dequantizes only the tokens it needs)."""
        mins = None if self.mins is None else self.mins[ids]
        return QuantizedWeight(self.codes[ids], self.scales[ids], mins, self.bits, self.kind)

    def _codes_by_group(self) -> torch.Tensor:
        n, k = self.shape
        if self.bits == 8:
            return self.codes.view(n, k // GROUP, GROUP)
        packed = self.codes.view(n, k // GROUP, GROUP // 2)
        return torch.cat([packed & 0x0F, packed >> 4], dim=-1)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights stacked (fused q/k/v and gate/up); all must share one format."""
        first = parts[0]
        if any(p.bits != first.bits or (p.mins is None) != (first.mins is None) for p in parts):
            raise ValueError("cannot stack quantized weights of different formats")
        mins = None if first.mins is None else torch.cat([p.mins for p in parts])
        kinds = sorted({p.kind for p in parts})
        return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                               mins, first.bits, "+".join(kinds))

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        return self.rows(order)

    def row_slice(self, start: int, end: int) -> QuantizedWeight:
        """Output rows [start, end) (a column-parallel shard): the same bytes, no re-quantization."""
        mins = None if self.mins is None else self.mins[start:end].contiguous()
        return QuantizedWeight(self.codes[start:end].contiguous(), self.scales[start:end].contiguous(), mins,
                               self.bits, self.kind)

    def column_slice(self, start: int, end: int) -> QuantizedWeight:
        """Inputs [start, end) (a row-parallel shard); both ends on a group boundary, so every group
        keeps its own scale and the shard holds exactly the file's numbers."""
        if start % GROUP or end % GROUP:
            raise ValueError(f"columns [{start}, {end}) do not start and end on groups of {GROUP}")
        g0, g1 = start // GROUP, end // GROUP
        per_byte = 2 if self.bits == 4 else 1
        codes = self.codes[:, start // per_byte : end // per_byte].contiguous()
        mins = None if self.mins is None else self.mins[:, g0:g1].contiguous()
        return QuantizedWeight(codes, self.scales[:, g0:g1].contiguous(), mins, self.bits, self.kind)


def to_blocked(w: QuantizedWeight) -> BlockedWeight:
    n, k = w.shape
    if n % 16:
        raise ValueError(f"{n} output rows is not a multiple of 16")
    g = k // GROUP
    # [N/16, G, quad, 64]: a quad's 4 codes of a column move as one int32 (blocked_formats.pack_codes)
    by_group = w._codes_by_group().contiguous()
    words = by_group.view(torch.int32).reshape(n // 16, 16, g, 8)
    q = words.permute(0, 2, 3, 1).contiguous().view(by_group.dtype).reshape(n // 16, g, 8, 64)
    if w.bits == 4:
        codes = (q[:, :, :4] | (q[:, :, 4:] << 4)).reshape(n // 16, g, 4, 64).contiguous()
    else:  # int8 + 128 as uint8 (flipping the sign bit): vpdpbusd's unsigned operand
        codes = (q.view(torch.uint8) ^ 0x80).reshape(n // 16, g, 8, 64).contiguous()

    def by_block(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.reshape(n // 16, 16, g).transpose(1, 2).contiguous()

    return BlockedWeight(codes.reshape(n // 16, g, w.bits * 64), by_block(w.scales), by_block(w.mins), w.bits, w.kind,
                         (n, k))


def to_blocked_gguf(type_name: str, raw: torch.Tensor, shape: tuple[int, int]) -> BlockedWeight:
    """A GGUF tensor of a KERNEL_TYPES type, from its file bytes uint8 [N, bytes per row] (the row's
    blocks in order; may be a view on a memory map: the result owns its memory), shape (N, K).
    Q4_0 / Q4_1 / Q8_0 go through the row layout, so their numbers are QuantizedWeight's. Raises
    ValueError naming the problem when N or K does not fit (N % 16, K % the format's block). Only
    the blocked kernels (VNNI, AVX2) read the result: call it where `quant_kernel.blocked_kernel()`."""
    n, k = shape
    if type_name in NATIVE_GGUF_TYPES:
        if n % 16:
            raise ValueError(f"a {type_name} weight of shape {shape}: {n} output rows is not a multiple of 16")
        blocks = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
        blocks = blocks.reshape(n, -1)
        return by_row_chunks(n, k, lambda r0, r1: to_blocked(from_gguf_blocks(type_name, blocks[r0:r1], (r1 - r0, k))))
    return blocked_from_file(type_name, raw, shape)


def from_gguf_blocks(kind: str, blocks: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor of a NATIVE_GGUF_TYPES type (raw uint8 blocks as the file holds them)."""
    n, k = shape
    if k % GROUP:
        raise ValueError(f"row length {k} is not a multiple of {GROUP}")
    raw = np.ascontiguousarray(blocks).reshape(n, k // GROUP, -1)
    d = torch.from_numpy(raw[..., 0:2].copy()).view(torch.float16).reshape(n, k // GROUP)
    if kind == "Q8_0":
        codes = torch.from_numpy(raw[..., 2:].copy()).view(torch.int8).reshape(n, k)
        return QuantizedWeight(codes, d, None, 8, kind)
    if kind == "Q4_1":
        m = torch.from_numpy(raw[..., 2:4].copy()).view(torch.float16).reshape(n, k // GROUP)
        codes = torch.from_numpy(raw[..., 4:].copy()).reshape(n, k // 2)
        return QuantizedWeight(codes, d, m, 4, kind)
    if kind == "Q4_0":
        # value = d * (q - 8) = d * q + (-8 d); -8 d is exact in fp16 and the sum is exact in fp32.
        codes = torch.from_numpy(raw[..., 2:].copy()).reshape(n, k // 2)
        return QuantizedWeight(codes, d, d * -8, 4, kind)
    raise ValueError(f"GGUF type {kind} is not kept quantized (native: {', '.join(NATIVE_GGUF_TYPES)})")


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 per group of 32 (as GGUF Q8_0): scale = max|w| / 127, codes round(w / scale)."""
    n, k = _check_quantizable(weight)
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    scales = (groups.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(scales == 0, torch.zeros((), dtype=torch.float32), 1 / scales.float())
    codes = torch.round(groups * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return QuantizedWeight(codes, scales, None, 8, "int8")


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """Asymmetric int4 per group of 32 (as GGUF Q4_1): scale = (max - min) / 15, codes 0..15."""
    n, k = _check_quantizable(weight)
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales = ((hi - lo) / 15).to(torch.float16)
    mins = lo.to(torch.float16)
    inv = torch.where(scales == 0, torch.zeros((), dtype=torch.float32), 1 / scales.float())
    q = torch.round((groups - mins.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    codes = q[..., :16] | (q[..., 16:] << 4)
    return QuantizedWeight(codes.reshape(n, k // 2).contiguous(), scales, mins, 4, "int4")


def _check_quantizable(weight: torch.Tensor) -> tuple[int, int]:
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise ValueError(f"only [N, K] matrices with K a multiple of {GROUP} can be quantized, got {tuple(weight.shape)}")
    return weight.shape[0], weight.shape[1]
