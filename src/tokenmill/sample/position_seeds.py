"""A seeded request's randomness, keyed by output position: the same seed gives the same tokens
however the request was batched, chunked, preempted or speculated.

A generator that lives with the request and is drawn from step after step makes its k-th token
depend on how many values the earlier steps drew. Speculative decoding varies that: a step samples
one verification row per draft (sample/speculative.py) and throws away the rows after the first
miss, and how many drafts a step gets depends on the step's token budget, the free KV pages and the
batch size (`disable_by_batch_size`), that is on the other requests. So each output position draws
from its own generator, seeded by a mix of (seed, position): the token at position p is a function
of p's logits and the seed alone. With drafts verified by sampling each row as an ordinary step
would, a seeded request's speculative output is then the same as its output without speculation.

torch's CPU generator (mt19937) keeps the low 32 bits of a seed, so the request's 64-bit seed is
mixed (splitmix64's finaliser) into the 32 bits it takes rather than truncated: seeds that differ
only above bit 31 still give different streams.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """splitmix64's finaliser: every input bit reaches every output bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The 32-bit generator seed of output position `position` (0 = the first output token) of a
    request seeded with `seed` (any value in [-2^63, 2^64); a negative seed is taken mod 2^64)."""
    if position < 0:
        raise ValueError(f"an output position is >= 0, got {position}")
    x = _mix64((seed & _MASK64) + _GOLDEN & _MASK64)
    x = _mix64(x ^ (position * _GOLDEN & _MASK64))
    return (x ^ (x >> 32)) & 0xFFFFFFFF


def position_generator(seed: int, position: int) -> torch.Generator:
    """A fresh CPU generator for the draws of one output position (a few microseconds to make)."""
    return torch.Generator().manual_seed(position_seed(seed, position))
