"""How K and V are laid out in the page pool's tensors, per `kv_cache_dtype` (fp32, bf16, int8).

Why a module of its own: the runner allocates the cache tensors, attention's PyTorch path writes and
reads them, the C++ kernels (csrc/kv_cache_rows.h) read them in place and the fused ops write them; all
of them must agree on one row format, and the pool's bytes per token follow from it.

Every layer's K (and V) cache is one tensor [num_kv_heads, num_slots, row_width]: one row per slot
(token) and KV head. fp32 and bf16 rows are the head_dim values. An int8 row is 4 bytes of fp32 scale
followed by head_dim int8 codes, value = code * scale, with scale = max|x| / 127 of that token and head
(symmetric, round to nearest even): the scale travels with its row, so every path that moves or reads
whole rows (pages, the prefix cache, preemption) needs nothing else. At head_dim 64 a row is 68 bytes
against 128 in bf16: the pool holds 1.88x the tokens in the same bytes.

The int8 codes are those of H x, not x, where H is the orthonormal Walsh-Hadamard matrix of the head
dim (for head dims 16-256 that are powers of two; csrc/kv_rotation.h). Keys have a few channels far
larger than the rest, which a scale per row leaves to the small ones' cost; H spreads them over the
row. On the bundled model that halves the KL of int8 against bf16 K/V (docs/benchmarks.md). H is
orthonormal and symmetric, so `decode` applies it again, and the kernels rotate queries and outputs
instead of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

INT8_SCALE_BYTES = 4  # the fp32 scale at the start of each int8 row
ROTATED_HEAD_DIMS = (16, 32, 64, 128, 256)  # int8 rows of these head dims hold codes of H x


def rotate(x: torch.Tensor) -> torch.Tensor:
    """H x along the last dimension (a power of two), H the orthonormal Walsh-Hadamard matrix in
    Sylvester's order ((-1)^popcount(i & j) / sqrt(n)): csrc/kv_rotation.h's butterflies, in the same
    order and float32 arithmetic, so the C++ writer and kernels get the same bits."""
    n = x.shape[-1]
    y = x.float()
    h = 1
    while h < n:
        pairs = y.reshape(*y.shape[:-1], n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        h *= 2
    return y * _inverse_sqrt(n)


@cache
def _inverse_sqrt(n: int) -> torch.Tensor:
    # 1.0f / std::sqrt(float(n)), rounded as float32 like the C++ side
    return torch.tensor(1.0, dtype=torch.float32) / torch.sqrt(torch.tensor(float(n), dtype=torch.float32))


@dataclass(frozen=True)
class KVCacheFormat:
    name: str  # fp32, bf16 or int8

    @staticmethod
    def named(name: str) -> KVCacheFormat:
        if name not in ("fp32", "bf16", "int8"):
            raise ValueError(f"unknown KV cache dtype {name!r} (fp32, bf16 or int8)")
        return KVCacheFormat(name)

    @staticmethod
    def resolve(kv_cache_dtype: str, precision: str) -> KVCacheFormat:
        """`auto`: bf16 in fast mode (decode attention at many rows is bound by reading the cache;
        32 rows x 400 tokens measured a step 67.6 -> 55.3 ms against fp32), fp32 in exact mode."""
        if kv_cache_dtype == "auto":
            return KVCacheFormat("bf16" if precision == "fast" else "fp32")
        return KVCacheFormat.named(kv_cache_dtype)

    @staticmethod
    def of(cache: torch.Tensor | torch.dtype) -> KVCacheFormat:
        """The format of a cache tensor (its element type says it), or of a storage dtype."""
        dtype = cache if isinstance(cache, torch.dtype) else cache.dtype
        return KVCacheFormat({torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}[dtype])

    @property
    def storage_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[self.name]

    def row_width(self, head_dim: int) -> int:
        """Elements of one slot's row for one KV head."""
        return head_dim + INT8_SCALE_BYTES if self.name == "int8" else head_dim

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of K and V one token holds in the pool, over all layers."""
        row = self.row_width(head_dim) * self.storage_dtype.itemsize
        return 2 * num_layers * num_kv_heads * row

    def allocate(self, num_kv_heads: int, num_slots: int, head_dim: int) -> torch.Tensor:
        # torch.empty: pages never touched cost no resident memory (the runner zeroes pages on first use).
        return torch.empty(num_kv_heads, num_slots, self.row_width(head_dim), dtype=self.storage_dtype)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Rows [..., row_width] of this format for float values [..., head_dim]."""
        if self.name != "int8":
            return values.to(self.storage_dtype)
        x = values.float()
        if self.rotated(x.shape[-1]):
            x = rotate(x)
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = amax / 127
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        codes = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
        return torch.cat([scale.view(torch.int8), codes], dim=-1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 values [..., head_dim] of rows [..., row_width] (the exact stored numbers)."""
        if self.name != "int8":
            return rows.float()
        values = self.stored_values(rows, torch.float32)
        return rotate(values) if self.rotated(values.shape[-1]) else values

    def rotated(self, head_dim: int) -> bool:
        """Whether rows of this format and head dim hold codes of H x rather than of x."""
        return self.name == "int8" and head_dim in ROTATED_HEAD_DIMS

    def stored_values(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values [..., head_dim] in `dtype` of rows [..., row_width] as stored: int8 rows as code x
        scale, still in the rotated basis where `rotated` says so (`decode` rotates them back)."""
        if self.name != "int8":
            return rows.to(dtype)
        scale = rows[..., :INT8_SCALE_BYTES].contiguous().view(torch.float32)
        return (rows[..., INT8_SCALE_BYTES:].float() * scale).to(dtype)

    @property
    def layout_name(self) -> str:
        """What a stored row means, for keys of rows kept outside the pool (the disk tier): int8 rows
        have changed meaning once (to rotated codes), so their name says which."""
        return "int8-hadamard" if self.name == "int8" else self.name

    def write(self, cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        """values [T, num_kv_heads, head_dim] into the cache rows at `slots` [T]."""
        cache.index_copy_(1, slots, self.encode(values.transpose(0, 1)))
EXACT_DEFAULT = KVCacheFormat("fp32")  # exact mode's (and a bare runner's) format
