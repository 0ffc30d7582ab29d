"""Pooling: the pooling a model's files declare, and the per-chunk part of pooling hidden rows.

A prompt may be computed over several steps (chunked prefill), so the runner reduces each chunk's
rows on its own (`chunk_pool`) and the engine combines the parts (engine/pooling.py): the last
chunk's last row, the first chunk's first row, or the sum of every chunk's sums.
"""

from __future__ import annotations

import json
import logging
import os

import torch

logger = logging.getLogger(__name__)

# GGUF `<arch>.pooling_type` (llama.cpp's enum llama_pooling_type): 0 none, 1 mean, 2 cls, 3 last, 4 rank.
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
# sentence-transformers' 1_Pooling/config.json flags, in the order it checks them.
_ST_MODES = (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
             ("pooling_mode_lasttoken", "last"))


def declared_pooling(path: str) -> str | None:
    """The pooling type the model's own files name, or None (the engine then pools the last token,
    the only choice that means something for a decoder trained left to right)."""
    try:
        if os.path.isdir(path):
            return _sentence_transformers_pooling(path)
        if path.lower().endswith(".gguf"):
            return _gguf_pooling(path)
    except (OSError, ValueError, KeyError) as exc:  # a broken side file must not stop the model loading
        logger.warning("cannot read the pooling type of %s (%s); pooling the last token", path, exc)
    return None


def _sentence_transformers_pooling(folder: str) -> str | None:
    modules_file = os.path.join(folder, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file) as f:
        modules = json.load(f)
    for module in modules:
        if str(module.get("type", "")).endswith(".Pooling"):
            with open(os.path.join(folder, module.get("path", ""), "config.json")) as f:
                config = json.load(f)
            for flag, kind in _ST_MODES:
                if config.get(flag):
                    return kind
    return None


def _gguf_pooling(path: str) -> str | None:
    # gguf_file's reader, not gguf-py's GGUFReader: that one parses the whole vocabulary (+180 MB
    # at its peak for SmolLM2's 49k tokens, seconds of time), on every engine start.
    from tokenmill.model.gguf_file import read_gguf

    metadata = read_gguf(path).metadata
    arch = metadata.get("general.architecture")
    value = None if arch is None else metadata.get(f"{arch}.pooling_type")
    return None if value is None else _GGUF_POOLING.get(int(value))


def chunk_pool(rows: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """One chunk's part of the pooled vector, fp32: its last row, its first row, or the sum of its rows."""
    rows = rows.float()
    if pooling_type == "last":
        return rows[-1].clone()
    if pooling_type == "cls":
        return rows[0].clone()
    return rows.sum(dim=0)
