"""tokenmill: an LLM inference engine with a paged KV cache and continuous batching."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputParams"]

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sample.sampling_params import SamplingParams, StructuredOutputParams


def __getattr__(name: str) -> Any:
    # Lazy, so `import tokenmill` (and the CLI's --help) does not pay for torch + transformers.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputParams"):
        from tokenmill.sample import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(name)
