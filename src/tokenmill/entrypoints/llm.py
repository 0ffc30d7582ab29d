"""The offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages, params)`.

`LLM(...)` is one engine in this process (`llm_in_process.py`); `LLM(..., data_parallel_size=N)` is
N engine processes behind the same API (`llm_data_parallel.py`), and still an `LLM`.
"""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.llm_data_parallel import DataParallelEngines
from tokenmill.entrypoints.llm_in_process import InProcessLLM, PromptType

__all__ = ["LLM", "DataParallelLLM", "PromptType"]


class LLM(InProcessLLM):
    def __new__(cls, model: str | None = None, **engine_args: Any) -> LLM:
        if cls is LLM and engine_args.get("data_parallel_size", 1) != 1:
            return super().__new__(DataParallelLLM)
        return super().__new__(cls)

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        engine_args.pop("data_parallel_size", None)  # 1 here (see __new__)
        super().__init__(model, **engine_args)


class DataParallelLLM(DataParallelEngines, LLM):
    """`LLM(model, data_parallel_size=N)`: DataParallelEngines' methods first, an LLM all the same."""
