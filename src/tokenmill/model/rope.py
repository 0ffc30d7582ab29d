"""Rotary position embeddings, computed exactly as Hugging Face does (fidelity depends on it)."""

from __future__ import annotations

import math

import torch

from tokenmill.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    # int64 arange then float, as transformers does: the float32 values must match bit for bit.
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if rope_type == "linear":  # positions divided by the factor (gemma3 4B+ global layers)
        return inv_freq / scaling["factor"]
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to the context length, filled as positions are looked up.

    The tables are allocated for the whole context (torch.empty: address space, not resident
    memory) and filled on demand, 4,096 positions at a time: Gemma 3 270M's two RoPEs (sliding and
    global layers) over its 32,768 positions x head_dim 256 in fp32 were 128 MiB resident from the
    load (512 MiB for 131k-context files), and their cos/sin ~2 s of CPU, for positions few requests
    reach. Filling never copies what is there, so each position is computed once.
    """

    FILL_POSITIONS = 4096  # positions filled at a time
    # Left on their 4 kB pages by model/huge_pages.py: moving the tables would make them resident
    # (Gemma 3 270M's four: 134 MB; the load's growth over its bound, docs/benchmarks.md, session 28).
    FILLED_ON_DEMAND = True
    # Positions per cos/sin call while filling: 64 x head_dim <= 16,384 floats stays under ATen's
    # grain size (32,768), so each call runs on one thread over whole SIMD vectors. A split across
    # threads can leave a chunk's tail to the scalar libm cos, which may round differently from the
    # vectorised one transformers' own (small, per-forward) calls use.
    _BLOCK = 64

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        self.inv_freq = inverse_frequencies(config)
        self.max_positions = max_positions
        dim = 2 * self.inv_freq.shape[0]
        self.cos = torch.empty(max_positions, dim)
        self.sin = torch.empty(max_positions, dim)
        self.filled = 0  # positions 0 .. filled - 1 hold their values
        self.ensure(1)

    def ensure(self, num_positions: int) -> None:
        """Positions 0 .. num_positions - 1 filled (a clear error past the context length)."""
        if num_positions <= self.filled:
            return
        if num_positions > self.max_positions:
            raise ValueError(f"position {num_positions - 1} is past the context length of {self.max_positions} "
                             "tokens the model was built for")
        step = self.FILL_POSITIONS
        end = min(-(-num_positions // step) * step, self.max_positions)
        # int64 arange then float, times inv_freq, as transformers does: each product is one exact
        # rounding, the same whichever positions are computed together.
        positions = torch.arange(self.filled, end, dtype=torch.int64).float()
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        for start in range(0, end - self.filled, self._BLOCK):
            rows = slice(self.filled + start, min(self.filled + start + self._BLOCK, end))
            block = emb[start : start + self._BLOCK]
            torch.cos(block, out=self.cos[rows])
            torch.sin(block, out=self.sin[rows])
        self.filled = end

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token, shaped [T, 1, head_dim]: looked up once per forward, not per layer."""
        if positions.numel() == 1:  # a batch-1 decode step: views of the tables' row, no gather
            p = int(positions.item())
            self.ensure(p + 1)
            return self.cos[p : p + 1, None], self.sin[p : p + 1, None]
        if positions.numel():
            self.ensure(int(positions.max()) + 1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] (q and k heads together: the same per-element arithmetic)."""
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
