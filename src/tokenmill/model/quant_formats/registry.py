"""One description per GGUF tensor type: block size, bytes a block, where its fp16 scales sit, and
whether the CPU kernels read its blocks as they are.

ggml keeps this as a table (`type_traits`) next to the block structs; this is the Python side of it,
gguf-py's table plus the types it does not know yet (newer_types.py).
The loader asks it how to cut a tensor into rows of whole blocks, the layer factory whether a kernel
takes the type, tensor parallelism where a shard may end (a block, 256 elements for K-quants, is
never split), and the tests where the fp16 fields are (random bytes are a valid block once those
are finite numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenmill.model.quant_formats.newer_types import NEWER_TYPES


@dataclass(frozen=True)
class QuantFormat:
    name: str  # GGUF type name: "Q4_K"
    block_elems: int  # weights a block holds (1 for unquantized types)
    block_bytes: int
    kernel: bool  # the C++ kernels read this type's blocks (or a lossless re-layout of them)
    fp16_offsets: tuple[int, ...] = ()  # byte offsets of the block's fp16 scales / mins
    # Prompt steps may dequantize it to bf16 for oneDNN's GEMM ("auto", layers/quantized_linear.py)
    bf16_prompt: bool = False
    type_id: int = -1  # ggml_type: the number a GGUF tensor table holds

    @property
    def quantized(self) -> bool:
        return self.block_elems > 1

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_elems

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k weights; ValueError when k is not a whole number of blocks."""
        if k % self.block_elems:
            raise ValueError(f"a row of {k} weights is not a whole number of {self.name} blocks "
                             f"({self.block_elems} weights each)")
        return k // self.block_elems * self.block_bytes


# The types the issue-22 kernels cover (csrc/, model/quant.py's KERNEL_TYPES must agree: tested).
_KERNEL = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                     "IQ4_NL", "IQ4_XS", "Q1_0", "Q2_0", "MXFP4"})
# Where each block keeps its fp16 fields (ggml-common.h's block structs). Types left out have none
# (unquantized, MXFP4's E8M0 byte) or pack the scale across bits (IQ1_M).
_FP16_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,), "Q1_0": (0,), "Q2_0": (0,),
}
UNQUANTIZED = frozenset({"F32", "F16", "BF16", "F64"})
# Types whose prompt steps run dequantize + oneDNN's bf16 GEMM by default (~12% less CPU than the
# two-term kernel). Rounding to bf16 moves a weight by ~2^(bits-9) of its format's step, small for
# 4-bit codes, but the GEMM also rounds activations and outputs to bf16, and how often that flips a
# near-tie depends on the file: measured on the held-out text (docs/benchmarks.md, "GGUF mixes:
# per-format prompt path"), top-1 vs exact stayed >= 99% with the bundled Q4_1 (99.10%), IQ4_NL /
# IQ4_XS (the IQ4_XS mix, 99.10%) and Q4_K (Q4_K_M's ffn_down, 99.33%), and fell to 98.77% with
# Q3_K_M's Q4_0 + Q4_K layers. Q4_K stays on the kernel too: on Gemma 3 270M, whose layers are
# mostly Q4_K, bf16 gave 99.02% (KL 5.5e-5) against the kernel's 99.41% (2.2e-5) and was no faster
# (pp512 738 vs 793 tok/s: on the kernel gemma's prompts run in the fused stack). Everything else
# (Q4_0, Q2_K/Q3_K/Q4_K, 5-8-bit codes) stays on the kernel. Q8_0 measured too (2026-12-02 (8)): its
# mix's prompt took 1.15x less CPU on bf16 but top-1 fell to 98.77% (an 8-bit code times its fp16
# scale keeps ~18 bits, bf16 8: the largest weight perturbation of any format here).
_BF16_PROMPT = frozenset({"Q4_1", "IQ4_NL", "IQ4_XS"})

# Every type by name, and by ggml type id (the number a GGUF tensor table holds).
_SIZES = {t.name: (t.value, elems, size) for t, (elems, size) in GGML_QUANT_SIZES.items()}
for _t in NEWER_TYPES.values():
    _SIZES.setdefault(_t.name, (_t.type_id, _t.block_elems, _t.block_bytes))
FORMATS: dict[str, QuantFormat] = {
    name: QuantFormat(name, elems, size, name in _KERNEL, _FP16_OFFSETS.get(name, ()), name in _BF16_PROMPT, type_id)
    for name, (type_id, elems, size) in _SIZES.items()
}
_BY_ID = {type_id: name for name, (type_id, _, _) in _SIZES.items()}


def format_of(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown GGUF tensor type {name!r}") from None


def format_by_id(type_id: int) -> QuantFormat:
    """The type a GGUF tensor table names by number; ValueError naming the number if no table here has
    it (a type newer than both gguf-py and this file)."""
    try:
        return FORMATS[_BY_ID[type_id]]
    except KeyError:
        raise ValueError(f"GGML tensor type {type_id} is unknown to this tokenmill and to gguf-py "
                         f"{_gguf_version()}") from None


def gguf_type(name: str) -> GGMLQuantizationType | None:
    """gguf-py's enum member for `name`, or None for a type only newer_types.py knows."""
    return GGMLQuantizationType.__members__.get(format_of(name).name)


def _gguf_version() -> str:
    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(version unknown)"
