"""GGUF block formats re-laid, without changing a bit of information, for the AVX512-VNNI kernels.

Why a file of its own: the kernels (csrc/quant_vnni.h, csrc/quant_blocks.h) read every format through
one loop skeleton, so every format must arrive in one shape. A `BlockedWeight` holds, per block of 16
output columns and group of 32 inputs, the unsigned codes of those 512 weights (`bits` x 64 bytes,
laid as csrc/quant_blocks.h describes), and the numbers that scale them:

- 32-wide formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): fp16 `scales` (and `mins`) per group;
- Q2_0 and Q1_0 (blocks of 64 and 128 inputs, one fp16 d each): `scales` per block, as the file has them;
- MXFP4 (E2M1 codes through their codebook): no fp16 `scales` (empty), its E8M0 exponent byte per group
  in `subs` (one byte per group and column), the kernels making 2^(e - 128) of it;
- 256-wide super-blocks (Q2_K .. Q6_K, IQ4_XS): fp16 `scales` (d) and `mins` (dmin) per super-block
  and the file's integer sub-block scales in `subs`, one byte each (6-bit ones unpacked to a byte:
  Q4_K's 12 bytes become 16, ~3% of the tensor; Q2_K's nibble pairs stay packed).

value = scale x (code - offset) + min, where the per-format offset (16 for Q5_0, 32 for Q6_K, 128 for
Q8_0 and the IQ4 codebook's bytes, 1 for Q2_0 and Q1_0, whose bit b the kernels read as the code 2 b,
...) is subtracted by the kernels in integer arithmetic. Every
value is the one gguf-py's `dequantize` gives (tests/model/test_block_decoders.py), and memory stays
within ~1.04x of the file's bytes.

The unpackers below follow gguf-py's `quants.py` (the bit-exact reference) for where each bit sits,
and ggml's own block structs for the types gguf-py does not know yet (quant_formats/newer_types.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from gguf.quants import Q4_K

from tokenmill.model.quant_formats import format_of, newer_types

COLS = 16
GROUP = 32
SUPER = 256
# IQ4_NL / IQ4_XS's non-linear 4-bit codebook (ggml's kvalues_iq4nl): codes stay 4-bit indices, the
# kernels look them up (+ 128, unsigned) with one byte shuffle per 64 codes (csrc/quant_blocks.h).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class BlockFormat:
    """What the kernels need to know of a GGUF type: its decoder id in csrc/quant_blocks.h, bits per
    code, whether its scales are per super-block (with `subs` bytes per super-block and column), and
    how many groups of 32 share one scale record (csrc/quant_blocks.h `fmt_scale_groups`)."""

    fmt: int
    bits: int
    super_block: bool
    subs: int = 0  # sub-block scale bytes per super-block and column
    has_mins: bool = False
    block_groups: int = 1  # groups of 32 sharing one fp16 d, outside super-blocks (Q2_0: 2, Q1_0: 4)

    @property
    def scale_groups(self) -> int:
        return SUPER // GROUP if self.super_block else self.block_groups


# The ids are csrc/quant_blocks.h's `Fmt` (4 and 8 keep the meaning of the bit widths they replace).
FORMATS: dict[str, BlockFormat] = {
    "Q4_0": BlockFormat(4, 4, False, has_mins=True),  # min = -8 d, as QuantizedWeight keeps it
    "Q4_1": BlockFormat(4, 4, False, has_mins=True),
    "Q8_0": BlockFormat(8, 8, False),
    "Q5_0": BlockFormat(10, 5, False),
    "Q5_1": BlockFormat(11, 5, False, has_mins=True),
    "IQ4_NL": BlockFormat(12, 4, False),
    "Q2_K": BlockFormat(20, 2, True, 16, True),
    "Q3_K": BlockFormat(21, 3, True, 16),
    "Q4_K": BlockFormat(22, 4, True, 16, True),
    "Q5_K": BlockFormat(23, 5, True, 16, True),
    "Q6_K": BlockFormat(24, 6, True, 16),
    "IQ4_XS": BlockFormat(25, 4, True, 8),
    "Q2_0": BlockFormat(13, 2, False, block_groups=2),
    "Q1_0": BlockFormat(14, 1, False, block_groups=4),
    "MXFP4": BlockFormat(15, 4, False, subs=1),
}
# Groups of 32 a scale record covers, by decoder id (weights quantized at load: 1).
_SCALE_GROUPS = {f.fmt: f.scale_groups for f in FORMATS.values()}


@dataclass
class BlockedWeight:
    """An [N, K] weight in the kernels' column-blocked layout (module docstring)."""

    codes: torch.Tensor  # uint8 [N/16, G, bits * 64]
    scales: torch.Tensor  # float16 [N/16, G or S, 16]
    mins: torch.Tensor | None  # float16 like scales, or None
    bits: int
    kind: str  # the GGUF type name ("Q4_K"), or "int4" / "int8" for weights quantized at load
    shape: tuple[int, int]
    subs: torch.Tensor | None = None  # uint8 [N/16, S, subs, 16] for super-block formats
    fmt: int = 0  # decoder id (BlockFormat.fmt); 0: the bit width's legacy decoder (4 or 8)

    def __post_init__(self) -> None:
        if self.fmt == 0:
            self.fmt = self.bits

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.mins, self.subs) if t is not None)

    @staticmethod
    def cat(parts: list[BlockedWeight]) -> BlockedWeight:
        """Output rows of several weights of one format stacked (fused q/k/v, gate/up): blocks of 16
        columns are independent, so the blocked tensors stack along their first dimension."""
        first = parts[0]
        if any(p.fmt != first.fmt or p.shape[1] != first.shape[1] or (p.mins is None) != (first.mins is None)
               for p in parts):
            raise ValueError("cannot stack blocked weights of different formats")

        def stack(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if ts[0] is None else torch.cat(ts)

        kinds = "+".join(sorted({p.kind for p in parts}))
        return BlockedWeight(stack([p.codes for p in parts]), stack([p.scales for p in parts]),
                             stack([p.mins for p in parts]), first.bits, kinds,
                             (sum(p.shape[0] for p in parts), first.shape[1]), stack([p.subs for p in parts]),
                             first.fmt)


    def row_slice(self, start: int, end: int) -> BlockedWeight:
        """Output rows [start, end) (a column-parallel shard), on blocks of 16: the same bytes."""
        if start % COLS or end % COLS:
            raise ValueError(f"rows [{start}, {end}) do not start and end on blocks of {COLS}")
        b0, b1 = start // COLS, end // COLS

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[b0:b1].contiguous()

        return BlockedWeight(cut(self.codes), cut(self.scales), cut(self.mins), self.bits, self.kind,
                             (end - start, self.shape[1]), cut(self.subs), self.fmt)

    @property
    def scale_width(self) -> int:
        """Inputs one scale record covers: 32, 256 for super-blocks, Q2_0's 64, Q1_0's 128."""
        return GROUP * _SCALE_GROUPS.get(self.fmt, 1)

    def column_slice(self, start: int, end: int) -> BlockedWeight:
        """Inputs [start, end) (a row-parallel shard). Both ends on the format's block (32, or 256 for
        super-blocks, which share one d and sub-block scales and are never split, 64 / 128 for Q2_0 /
        Q1_0): every value keeps its own scales, the shard holds exactly the file's numbers."""
        width = self.scale_width
        if start % width or end % width:
            raise ValueError(f"a {self.kind} weight's inputs [{start}, {end}) would split its blocks of {width}")
        g0, g1 = start // GROUP, end // GROUP
        s0, s1 = start // width, end // width  # the scales' index: groups, or super-blocks

        def cut(t: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
            return None if t is None else t[:, a:b].contiguous()

        return BlockedWeight(cut(self.codes, g0, g1), cut(self.scales, s0, s1), cut(self.mins, s0, s1), self.bits,
                             self.kind, (self.shape[0], end - start), cut(self.subs, s0, s1), self.fmt)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes uint8 [N, K] (< 2**bits) into the blocked bytes [N/16, K/32, bits * 64].

    Quad j of a group (inputs 4j..4j+3) of a block is 64 bytes, byte 4c + e = column c, input 4j + e.
    The low bits of the 8 quads go in nibbles (zmm t: quad t low, quad t + 4 high) or crumbs (zmm t of
    2: quad t + 2s at bits 2s); a 5th / 3rd bit in one plane (bit j = quad j); Q6_K's top two bits in
    crumbs again, after the nibbles. 8-bit codes are the quads as they are; 1-bit codes one plane."""
    n, k = q.shape
    g = k // GROUP
    # A quad's 4 codes of a column move together: permuted as one int32 each (a quarter of the
    # elements a uint8 permute copies one by one).
    words = q.contiguous().view(torch.int32).reshape(n // COLS, COLS, g, 8)
    quads = words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(n // COLS, g, 8, 64)

    def nibbles(v: torch.Tensor) -> torch.Tensor:
        if bits == 4:  # codes < 16 already: two passes over the weight fewer (loading is these passes)
            return v[:, :, :4] | (v[:, :, 4:] << 4)
        return (v[:, :, :4] & 0x0F) | ((v[:, :, 4:] & 0x0F) << 4)

    def crumbs(v: torch.Tensor) -> torch.Tensor:
        v = v & 0x03
        return torch.stack([v[:, :, t] | (v[:, :, t + 2] << 2) | (v[:, :, t + 4] << 4) | (v[:, :, t + 6] << 6)
                            for t in (0, 1)], dim=2)

    def plane(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(v[:, :, :1])
        for j in range(8):
            out |= (v[:, :, j : j + 1] & 1) << j
        return out

    if bits == 8:
        parts = [quads]
    elif bits == 1:
        parts = [plane(quads)]
    elif bits == 2:
        parts = [crumbs(quads)]
    elif bits == 3:
        parts = [crumbs(quads), plane(quads >> 2)]
    elif bits == 4:
        parts = [nibbles(quads)]
    elif bits == 5:
        parts = [nibbles(quads), plane(quads >> 4)]
    elif bits == 6:
        parts = [nibbles(quads), crumbs(quads >> 4)]
    else:
        raise ValueError(f"no blocked layout for {bits}-bit codes")
    packed = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # one part: no copy
    return packed.reshape(n // COLS, g, bits * 64).contiguous()


def by_block(t: np.ndarray | torch.Tensor | None) -> torch.Tensor | None:
    """Per-row numbers [N, X, ...] into per-block ones [N/16, X, ..., 16] (16 columns side by side)."""
    if t is None:
        return None
    t = torch.as_tensor(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t
    n = t.shape[0]
    t = t.reshape(n // COLS, COLS, *t.shape[1:])
    return t.movedim(1, -1).contiguous()


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """Blocks' 16 bytes of a 32-wide group: element j low nibble, j + 16 high (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of a little-endian bit field of `count` bits, as uint8 [..., count]."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]


def _unpack(kind: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """File blocks uint8 [N, B, block bytes] -> (codes [N, K], scales, mins, subs), numpy."""
    n = b.shape[0]
    if kind in ("Q5_0", "Q5_1"):
        off = 2 if kind == "Q5_0" else 4
        d = _f16(b[..., 0:2])
        m = _f16(b[..., 2:4]) if kind == "Q5_1" else None
        q = _nibbles32(b[..., off + 4 :]) | (_high_bits(b[..., off : off + 4], 32) << 4)
        return q.reshape(n, -1), d, m, None
    if kind == "IQ4_NL":
        return _nibbles32(b[..., 2:]).reshape(n, -1), _f16(b[..., 0:2]), None, None
    if kind in newer_types.NEWER_TYPES:  # Q2_0's crumbs, Q1_0's bits; d per block of 64 / 128
        d, q = newer_types.codes(kind, b)
        return q.reshape(n, -1), d, None, None
    if kind == "MXFP4":  # the E8M0 exponent byte, then codebook indices in IQ4_NL's nibble order
        return _nibbles32(b[..., 1:17]).reshape(n, -1), None, None, np.ascontiguousarray(b[..., 0])
    if kind == "Q2_K":
        scales, qs = b[..., 0:16], b[..., 16:80]
        q = (qs.reshape(*qs.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
        return q.reshape(n, -1), _f16(b[..., 80:82]), _f16(b[..., 82:84]), scales
    if kind == "Q3_K":
        hmask, qs, packed = b[..., 0:32], b[..., 32:96], b[..., 96:108]
        low = (packed[..., None, 0:8] >> np.array([0, 4], np.uint8).reshape(2, 1)).reshape(*packed.shape[:-1], 16) & 0x0F
        high = (packed[..., 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)).swapaxes(-1, -2)
        sc = (low | ((high.reshape(*packed.shape[:-1], 16) & 3) << 4)).astype(np.int16) - 32
        ql = (qs.reshape(*qs.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
        qh = (hmask[..., None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        q = ql.reshape(*qs.shape[:-1], 256) | (qh.reshape(*qs.shape[:-1], 256) << 2)
        return q.reshape(n, -1), _f16(b[..., 108:110]), None, sc.astype(np.int8).view(np.uint8)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        flat = np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12)
        sc, m = Q4_K.get_scale_min(flat)
        subs = np.concatenate([sc.reshape(-1, 8), m.reshape(-1, 8)], axis=-1).reshape(*b.shape[:-1], 16)
        qs = b[..., 16:144] if kind == "Q4_K" else b[..., 48:176]
        q = (qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
        q = q.reshape(*qs.shape[:-1], 256)
        if kind == "Q5_K":
            qh = (b[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
            q = q | (qh.reshape(*qs.shape[:-1], 256) << 4)
        return q.reshape(n, -1), d, dmin, subs.astype(np.uint8)
    if kind == "Q6_K":
        ql, qh, sc = b[..., 0:128], b[..., 128:192], b[..., 192:208]
        lo = (ql.reshape(*ql.shape[:-1], 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
        hi = (qh.reshape(*qh.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
        q = lo.reshape(*ql.shape[:-1], 256) | (hi.reshape(*ql.shape[:-1], 256) << 4)
        return q.reshape(n, -1), _f16(b[..., 208:210]), None, np.ascontiguousarray(sc)
    if kind == "IQ4_XS":
        d = _f16(b[..., 0:2])
        sh = np.ascontiguousarray(b[..., 2:4]).view(np.uint16)[..., 0]
        sl = b[..., 4:8]
        low = (sl[..., None] >> np.array([0, 4], np.uint8)).reshape(*sl.shape[:-1], 8) & 0x0F
        high = (sh[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
        ls = (low | (high.astype(np.uint8) << 4)).astype(np.int16) - 32
        q = _nibbles32(b[..., 8:136].reshape(*b.shape[:-1], 8, 16))
        return q.reshape(n, -1), d, None, ls.astype(np.int8).view(np.uint8)
    raise ValueError(f"GGUF type {kind} has no kernel (kernel types: {', '.join(sorted(FORMATS))})")


def blocked_from_file(kind: str, raw: torch.Tensor | np.ndarray, shape: tuple[int, int]) -> BlockedWeight:
    """A tensor of one of FORMATS other than Q4_0 / Q4_1 / Q8_0 (those go through QuantizedWeight
    so that their numbers stay those of the row layout), from its file bytes uint8 [N, row bytes]."""
    n, k = shape
    f = FORMATS.get(kind)
    if f is None:
        raise ValueError(f"GGUF type {kind} has no kernel (kernel types: {', '.join(sorted(FORMATS))})")
    block, size = format_of(kind).block_elems, format_of(kind).block_bytes
    if n % COLS or k % block:
        raise ValueError(f"a {kind} weight of shape {shape} does not fit the blocked layout: needs N % {COLS} == 0 "
                         f"and K % {block} == 0")
    data = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    if data.dtype != np.uint8 or data.size != n * (k // block) * size:
        raise ValueError(f"{kind} {shape}: expected {n * (k // block) * size} uint8 bytes, got {data.size} {data.dtype}")
    data = data.reshape(n, k // block, size)

    def convert(r0: int, r1: int) -> BlockedWeight:
        codes, d, m, subs = _unpack(kind, data[r0:r1])
        packed = pack_codes(torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)), f.bits)
        records = k // (GROUP * f.scale_groups)  # scale records a row
        subs_t = None if subs is None else by_block(subs.reshape(r1 - r0, records, f.subs))
        mins = None if m is None else by_block(m.astype(np.float16))
        scales = (by_block(d.astype(np.float16)) if d is not None
                  else torch.empty((r1 - r0) // COLS, 0, COLS, dtype=torch.float16))  # MXFP4: exponents only
        return BlockedWeight(packed, scales, mins, f.bits, kind, (r1 - r0, k), subs_t, f.fmt)

    return by_row_chunks(n, k, convert)


# Rows converted at a time: the unpacking's temporaries (a byte per weight, a few times over) stay a
# few MB however large the tensor, so loading a model peaks near its file size.
CHUNK_WEIGHTS = 1 << 22
# Chunks converted side by side, at most: numpy and torch release the GIL in their kernels, and the
# conversion is the load (Llama 3 8B's shape in Q4_K: 26-32 s of CPU; 2 threads: load 26-32 -> 14-23 s).
MAX_CONVERT_THREADS = 8


def by_row_chunks(n: int, k: int, convert) -> BlockedWeight:
    """convert(r0, r1) -> BlockedWeight of rows [r0, r1), for chunks of whole blocks of 16 rows, copied
    into one preallocated weight (no second full-size copy, as a final concatenation would make). The
    chunks after the first are converted by as many threads as torch uses (up to MAX_CONVERT_THREADS),
    each writing its own rows."""
    step = max(COLS, CHUNK_WEIGHTS // max(k, 1) // COLS * COLS)
    first = convert(0, min(n, step))
    if first.shape[0] == n:
        return first

    def like(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.empty((n // COLS, *t.shape[1:]), dtype=t.dtype)

    out = BlockedWeight(like(first.codes), like(first.scales), like(first.mins), first.bits, first.kind, (n, k),
                        like(first.subs), first.fmt)

    def place(r0: int, part: BlockedWeight) -> None:
        b0, b1 = r0 // COLS, r0 // COLS + part.shape[0] // COLS
        for dst, src in ((out.codes, part.codes), (out.scales, part.scales), (out.mins, part.mins),
                         (out.subs, part.subs)):
            if dst is not None:
                dst[b0:b1] = src

    place(0, first)
    rest = range(step, n, step)
    workers = max(1, min(torch.get_num_threads(), MAX_CONVERT_THREADS, len(rest)))
    with ThreadPoolExecutor(workers) as pool:
        for _ in pool.map(lambda r0: place(r0, convert(r0, min(n, r0 + step))), rest):
            pass  # each result is None; iterating raises a chunk's error here
    return out
