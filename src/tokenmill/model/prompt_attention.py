"""A prompt chunk's attention in bf16 on AMX tiles (our kernel, else torch's flash attention), on CPUs
whose AMX makes that faster.

Why: fast mode attends prompts as runs of decode rows in the paged kernel (csrc/paged_attention_runs.h),
whose bf16 pair products run on the vector units. On a CPU with AMX, torch's flash attention
(`scaled_dot_product_attention`, oneDNN's AMX brgemm inside) multiplies the same bf16 values on the
tiles: on a 2-core Xeon with AMX it attended SmolLM2's 512-token prompt in 1.1 ms a layer against the
kernel's 2.05, and made a whole 2,048-token prompt 1.8x faster (docs/benchmarks.md, "Prompt attention
on AMX"). Our own tile kernel (csrc/prompt_flash_amx.h, reading K/V from the cache's pages) is
1.3-2.25x torch's there, most at a long chunk after its prefix ("Our own prompt attention on the
tiles"); torch's stays the path where that kernel is not built. Without AMX the paged kernel is kept:
on Zen 5 it ran 0.72 ms a layer at 512 (session 12), and on Zen 4 whole prompts of the Q8_0 mix took
362-420 ms (512 tokens) and 1.94-2.08 s (2,048) on it against 478-533 ms and 2.67-2.96 s with
TOKENMILL_PROMPT_ATTENTION=sdpa (docs/benchmarks.md, session 38).

What it computes is the kernel's arithmetic in another order: bf16 queries, keys and values, fp32
scores and softmax, bf16 weights times bf16 values summed in fp32. K/V come from the pages the step has
just written: bf16 rows as they lie; int8 rows as code x scale rounded to bf16, left in the rotated
basis they are stored in (H k, H v: kv_cache_format.py), so the queries are rotated on the way in and
the outputs on the way out, as the kernel does (q . k = Hq . Hk, and sum w v = H sum w Hv), or, where
the context has fewer vectors than the chunk's queries (a fresh prompt with grouped KV heads), the keys
and values are rotated back instead.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from tokenmill.model.kernels import cpu_isa, fused_ops, prompt_flash
from tokenmill.model.kv_cache_format import KVCacheFormat, rotate

# From this many queries a chunk after a cached prefix attends in two calls (_causal_after_prefix)
# instead of one under a mask: 1,024 over 2,048 keys 8.2 -> 6.8 ms, 2,048 over 4,096 33.4 -> 22.6 ms;
# at 256 over 2,048 the merge cost more than it saved (2.4 -> 2.7 ms).
SPLIT_MIN_QUERIES = 512
# auto (unset), tiles, sdpa or kernel: to measure each path anywhere it runs
CHOICE_ENV = "TOKENMILL_PROMPT_ATTENTION"
CHOICES = ("auto", "tiles", "sdpa", "kernel")


def _choice() -> str:
    choice = os.environ.get(CHOICE_ENV, "").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{CHOICE_ENV}={choice!r} is not one of {', '.join(CHOICES)}")
    return choice


@functools.cache
def faster_here() -> bool:
    """Whether fast mode's long prompt chunks take this path: by default where the CPU has AMX tiles and
    the cap allows them (TOKENMILL_CPU_ISA unset or amx); TOKENMILL_PROMPT_ATTENTION=tiles|sdpa|kernel
    decides instead (a value it does not know is an error that names it)."""
    choice = _choice()
    if choice != "auto":
        return choice != "kernel"
    return cpu_isa.cap() == "amx" and bool(torch.cpu._is_amx_tile_supported())


@functools.cache
def on_tiles() -> bool:
    """Whether this path attends on our AMX kernel (csrc/prompt_flash_amx.h) rather than torch's flash
    attention: where it is built and the process may run tiles, unless TOKENMILL_PROMPT_ATTENTION=sdpa."""
    return _choice() in ("auto", "tiles") and prompt_flash.available()


def on_tiles_for(head_dim: int) -> bool:
    """Whether a chunk of this head dim attends on our tile kernel (whose tiles take multiples of 16)."""
    return on_tiles() and head_dim % 16 == 0 and head_dim <= 256


def attend(q: torch.Tensor,  # [q_len, heads, head_dim]: the chunk's queries, the last q_len positions
           keys: torch.Tensor,  # [kv_heads, kv_len, row]: the context's stored K rows, in position order
           values: torch.Tensor,
           fmt: KVCacheFormat,
           scale: float | None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:  # [q_len, heads, head_dim] (default: q's dtype)
    """Causal attention of the chunk's queries over the context's rows, in bf16 on the tiles."""
    if on_tiles_for(q.shape[-1]):  # the rows as one page of kv_len slots
        return attend_pages(q, keys, values, _ONE_PAGE, keys.shape[1], keys.shape[1], fmt, scale, out_dtype)
    out_dtype = out_dtype or q.dtype
    q_len, kv_len = q.shape[0], keys.shape[1]
    rotated = fmt.rotated(q.shape[-1])
    rotate_queries = rotates_queries(fmt, q.shape[-1], q_len * q.shape[1], kv_len * keys.shape[0])
    query = (_rotate(q) if rotate_queries else q).to(torch.bfloat16).transpose(0, 1).unsqueeze(0)
    k, v = (_values(rows, fmt, rotated and not rotate_queries).unsqueeze(0) for rows in (keys, values))
    if kv_len == q_len:
        out = F.scaled_dot_product_attention(query, k, v, is_causal=True, enable_gqa=True, scale=scale)
    elif q_len >= SPLIT_MIN_QUERIES:
        out = _causal_after_prefix(query, k, v, kv_len - q_len, scale, out_dtype == torch.bfloat16 and not rotate_queries)
    else:
        # The chunk's queries sit at the end of the context: query i sees keys 0..offset + i.
        offset = kv_len - q_len
        mask = torch.arange(kv_len).unsqueeze(0) <= torch.arange(offset, kv_len).unsqueeze(1)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
    out = out.squeeze(0).transpose(0, 1)
    return (_rotate(out) if rotate_queries else out).to(out_dtype)


_ONE_PAGE = torch.zeros(1, dtype=torch.long)


def attend_pages(q: torch.Tensor,  # [q_len, heads, head_dim]: the chunk's queries, the last q_len positions
                 k_cache: torch.Tensor,  # [kv_heads, slots, row]: a layer's cache
                 v_cache: torch.Tensor,
                 pages: torch.Tensor,  # the sequence's pages, in position order
                 kv_len: int,
                 page_size: int,
                 fmt: KVCacheFormat,
                 scale: float | None,
                 out_dtype: torch.dtype | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """attend() on our tile kernel (on_tiles_for must hold), which reads K / V from the cache's pages
    (no gathered copy, int8 rows turned into bf16 as it packs them). Written into `out` where it is
    given, of out_dtype and contiguous, and the queries are not rotated; returned either way."""
    out_dtype = out_dtype or q.dtype
    head_dim = q.shape[-1]
    rotate_queries = rotates_queries(fmt, head_dim, q.shape[0] * q.shape[1], kv_len * k_cache.shape[0])
    query = (_rotate(q) if rotate_queries else q).to(torch.bfloat16)
    bf16_out = out_dtype == torch.bfloat16 and not rotate_queries
    into = out if out is not None and not rotate_queries and out.dtype == out_dtype and out.is_contiguous() else None
    result = prompt_flash.attend(query, k_cache, v_cache, pages, kv_len, page_size, scale or head_dim**-0.5, bf16_out,
                                 fmt.rotated(head_dim) and not rotate_queries, into)
    return (_rotate(result) if rotate_queries else result).to(out_dtype)


def rotates_queries(fmt: KVCacheFormat, head_dim: int, query_vectors: int, kv_vectors: int) -> bool:
    """Whether a chunk over rows stored in a rotated basis (int8) rotates its queries and outputs into
    that basis (float32 queries in, float32 outputs out), rather than its keys and values back out of
    it: whichever side has fewer vectors (with GQA a fresh chunk has `group` times more queries)."""
    return fmt.rotated(head_dim) and query_vectors <= kv_vectors


def _values(rows: torch.Tensor, fmt: KVCacheFormat, unrotate: bool) -> torch.Tensor:
    """The rows' values in bf16: as stored, or rotated back out of H's basis (in fp32, then rounded).
    int8 rows take one pass of the fused op where it is built: three to five passes of torch ops (to
    float, times the scale, a product with H, to bf16) cost an int8 prompt ~8 % more than a bf16 one
    (docs/benchmarks.md, "Issue 26's int8 prompts cost what bf16 ones do")."""
    if fmt.name == "int8" and fused_ops.available():
        return fused_ops.int8_rows_values(rows, unrotate)
    if not unrotate:
        return fmt.stored_values(rows, torch.bfloat16)
    return _rotate(fmt.stored_values(rows, torch.float32)).to(torch.bfloat16)


def _causal_after_prefix(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                         scale: float | None, bf16_out: bool = False) -> torch.Tensor:
    """A long chunk over its cached prefix (no mask) and over itself (causal), merged by the two parts'
    log-sum-exps: one masked call computes every position of the chunk's own square as well. float32,
    or bf16 (the float32 result rounded) with bf16_out.

    The merge, own + (prefix - own) * share, is one pass of the fused op where it is built (four
    passes of torch ops took ~0.9 of ~8 ms a layer for 992 queries over 1,992 keys), the same numbers."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # what SDPA calls here, with the lse
    prefix, prefix_lse = flash(query, k[:, :, :offset], v[:, :, :offset], 0.0, False, scale=scale)
    own, own_lse = flash(query, k[:, :, offset:], v[:, :, offset:], 0.0, True, scale=scale)
    prefix_share = torch.sigmoid(prefix_lse - own_lse)  # of each query's softmax mass
    if fused_ops.available():
        return fused_ops.merge_attention(own, prefix, prefix_share, bf16_out)
    own = own.float()
    merged = own.add_((prefix.float() - own).mul_(prefix_share.unsqueeze(-1)))
    return merged.to(torch.bfloat16) if bf16_out else merged


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """H x along the last dimension in fp32, as one product with H: kv_cache_format.rotate's butterflies
    are a dozen small ops a level, which cost a 2,048-token prompt ~0.5 s over 30 layers."""
    return x.float() @ _hadamard(x.shape[-1])


@functools.cache
def _hadamard(n: int) -> torch.Tensor:
    return rotate(torch.eye(n))  # symmetric: x @ H is H x for each row x
