"""`LLM(model, data_parallel_size=N)`: N whole engines, each in a process of its own with its own KV
pool and `num_threads // N` threads, behind the one offline API.

`generate` tokenizes here, hands each replica a share of the prompts (least tokens first: the longest
prompt + max_tokens goes to the replica with the fewest so far, so shares finish together) and puts the
outputs back in the caller's order. A prompt's n samples stay on one replica (one request). Replicas
are started with the `spawn` method: a script that builds this LLM at import time needs the usual
`if __name__ == "__main__":` guard, as with vLLM and any multiprocessing code.
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from tokenmill.config import DataParallelConfig, EngineConfig
from tokenmill.entrypoints.llm import LLM, PromptType, _as_params_list, _as_prompt_list
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.outputs import RequestOutput
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.model.default_model import default_model_path
from tokenmill.sample.sampling_params import SamplingParams

_replica: LLM | None = None  # in a replica process: its engine


def _on_replica(model: str | None, engine_args: dict[str, Any], method: str, *args: Any) -> Any:
    global _replica
    if _replica is None:
        _replica = LLM(model, **engine_args)
    return getattr(_replica, method)(*args)


class DataParallelLLM(LLM):
    def __init__(self, model: str | None = None, data_parallel_size: int = 2, **engine_args: Any) -> None:
        DataParallelConfig(data_parallel_size)  # checks the size
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)  # fails here, not in N processes
        threads = max(1, self.config.threads // data_parallel_size)
        self._start = (model, {**engine_args, "num_threads": threads})
        context = multiprocessing.get_context("spawn")
        self.replicas = [ProcessPoolExecutor(1, mp_context=context) for _ in range(data_parallel_size)]
        self.tokenizer = Tokenizer.from_model_path(model or default_model_path())
        self._ids = itertools.count()
        try:
            self._on_all("stats")  # every replica loads its engine now, all at once
        except BaseException:
            self.shutdown()
            raise

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        tokenized = [self._tokenize(p) for p in prompt_list]
        shares: list[list[int]] = [[] for _ in self.replicas]
        load = [0] * len(self.replicas)
        size = [len(ids) + (p.max_tokens or 0) * p.n for (_, ids), p in zip(tokenized, params_list)]
        for i in sorted(range(len(prompt_list)), key=lambda i: -size[i]):
            r = load.index(min(load))
            shares[r].append(i)
            load[r] += size[i]
        futures = [
            (share, replica.submit(_on_replica, *self._start, "generate",
                                   [{"prompt": tokenized[i][0], "prompt_token_ids": tokenized[i][1]} for i in share],
                                   [params_list[i] for i in share], False))
            for replica, share in zip(self.replicas, shares) if share
        ]
        results: list[RequestOutput | None] = [None] * len(prompt_list)
        for share, future in futures:
            for i, out in zip(share, future.result()):
                results[i] = out
        first = next(self._ids)
        for _ in range(len(prompt_list) - 1):
            next(self._ids)
        return [replace(out, request_id=str(first + i)) for i, out in enumerate(results) if out is not None]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None):
        raise InvalidRequest("stream() runs one request, which one engine serves: use data_parallel_size 1",
                             param="data_parallel_size")

    def stats(self) -> dict[str, int]:
        """The replicas' counters summed (`replicas` holds each one's)."""
        each = self._on_all("stats")
        total: dict[str, Any] = {k: sum(s[k] for s in each) for k in each[0] if isinstance(each[0][k], (int, float))}
        queries = total.get("prefix_cache_queries_tokens_total", 0)
        total["prefix_cache_hit_rate"] = total.get("prefix_cache_hit_tokens_total", 0) / queries if queries else 0.0
        total["replicas"] = each
        return total

    def check_integrity(self) -> None:
        self._on_all("check_integrity")

    def reset_prefix_cache(self) -> bool:
        return all(self._on_all("reset_prefix_cache"))

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown(wait=True, cancel_futures=True)

    def _on_all(self, method: str) -> list[Any]:
        futures = [replica.submit(_on_replica, *self._start, method) for replica in self.replicas]
        return [f.result() for f in futures]
