"""Wrapper of the MoE experts op (csrc/moe_experts.cpp), built on first use: a prompt step's routed
experts dealt out to the threads, each expert run whole on one thread, with the op-by-op fast path's
numbers bit for bit (model/moe.py decides when it applies).

`available()` is False where the VNNI kernel does not run or the extension cannot be built (or
TOKENMILL_DISABLE_CPU_KERNEL=1): model/moe.py then runs the experts one op at a time.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.model.kernels import quant_kernel
from tokenmill.model.kernels.cpp_build import LazyExtension
from tokenmill.model.quant import BlockedWeight

logger = logging.getLogger(__name__)

_EXTENSION = LazyExtension("moe_experts", "CPU MoE experts op", logger)


def available() -> bool:
    return quant_kernel.blocked_kernel() == "vnni" and _EXTENSION.available()


class BoundExperts:
    """A block's experts' weights as the op takes them, gathered once; `__call__` passes the active
    ones (counts > 0) in ascending order."""

    def __init__(self, gate_up: list[BlockedWeight], down: list[BlockedWeight]) -> None:
        def args(w: BlockedWeight) -> tuple[list[torch.Tensor], int, int]:
            return [w.codes, w.scales, quant_kernel.or_empty(w.mins), quant_kernel.or_empty(w.subs)], w.fmt, w.shape[0]

        self.gate_up = [args(w) for w in gate_up]
        self.down = [args(w) for w in down]

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """out [T, H]: each token's experts' outputs times its routing weights, added in ascending
        expert order. tokens / weights: the assignments grouped by expert (ascending), counts: rows
        per expert (every expert of the block, zeros included)."""
        active = [e for e, c in enumerate(counts) if c]
        gu = [self.gate_up[e] for e in active]
        dn = [self.down[e] for e in active]
        return torch.ops.tokenmill_moe.experts.default(
            x, tokens, weights, [counts[e] for e in active],
            [t for a in gu for t in a[0]], [a[1] for a in gu], [a[2] for a in gu],
            [t for a in dn for t in a[0]], [a[1] for a in dn], [a[2] for a in dn])
