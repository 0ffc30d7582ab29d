"""`LLM(model, data_parallel_size=N)`: N whole engines, each in a process of its own with its own KV
pool and `num_threads // N` threads, behind the one offline API.

`generate` tokenizes here (InProcessLLM's own), hands each replica a share of the prompts (least tokens first: the longest
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
from tokenmill.entrypoints.llm_calls import CallGuard
from tokenmill.entrypoints.llm_in_process import InProcessLLM, PromptType, _as_prompt_list
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.outputs import RequestOutput
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.model.default_model import default_model_path
from tokenmill.pooling_params import PoolingParams
from tokenmill.sample.sampling_params import SamplingParams

_replica: InProcessLLM | None = None  # in a replica process: its engine


def _on_replica(model: str | None, engine_args: dict[str, Any], method: str, *args: Any) -> Any:
    global _replica
    if _replica is None:
        _replica = InProcessLLM(model, **engine_args)
    return getattr(_replica, method)(*args)


class DataParallelEngines(InProcessLLM):
    """InProcessLLM's API over N engine processes (`llm.py` makes it an `LLM`: DataParallelLLM)."""

    def __init__(self, model: str | None = None, data_parallel_size: int = 2, **engine_args: Any) -> None:
        DataParallelConfig(data_parallel_size)  # checks the size
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)  # fails here, not in N processes
        threads = max(1, self.config.threads // data_parallel_size)
        self._start = (model, {**engine_args, "num_threads": threads})
        context = multiprocessing.get_context("spawn")
        self.replicas = [ProcessPoolExecutor(1, mp_context=context) for _ in range(data_parallel_size)]
        self.tokenizer = Tokenizer.from_model_path(model or default_model_path())
        self._ids = itertools.count()
        self._calls = CallGuard()
        try:
            self._on_all("stats")  # every replica loads its engine now, all at once
        except BaseException:
            self.shutdown()
            raise

    def _run(self, results: list[RequestOutput], params_list: list[SamplingParams], show_progress: bool) -> None:
        """LLM.generate's last step, across replicas: each runs its share, and its outputs are copied
        into the caller's RequestOutputs (their ids and order stay the caller's)."""
        shares: list[list[int]] = [[] for _ in self.replicas]
        load = [0] * len(self.replicas)
        size = [r.num_prompt_tokens + (p.max_tokens or 0) * p.n for r, p in zip(results, params_list)]
        for i in sorted(range(len(results)), key=lambda i: -size[i]):
            r = load.index(min(load))
            shares[r].append(i)
            load[r] += size[i]
        futures = [
            (share, replica.submit(_on_replica, *self._start, "generate",
                                   [{"prompt": results[i].prompt, "prompt_token_ids": results[i].prompt_token_ids}
                                    for i in share], [params_list[i] for i in share], False))
            for replica, share in zip(self.replicas, shares) if share
        ]
        for share, future in futures:
            for i, out in zip(share, future.result()):
                results[i] = replace(out, request_id=results[i].request_id)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None) -> list[list[float]]:
        """LLM.embed across replicas: every replica embeds every N-th prompt; vectors in the caller's order."""
        items = _as_prompt_list(prompts)
        n = len(self.replicas)
        with self._calls.call():
            futures = [replica.submit(_on_replica, *self._start, "embed", items[r::n], pooling_params)
                       for r, replica in enumerate(self.replicas) if items[r::n]]
            vectors: list[list[float]] = [[] for _ in items]
            for r, future in enumerate(futures):
                vectors[r::n] = future.result()
        return vectors

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
        self._calls.closed = True
        for replica in self.replicas:
            replica.shutdown(wait=True, cancel_futures=True)

    def _on_all(self, method: str) -> list[Any]:
        futures = [replica.submit(_on_replica, *self._start, method) for replica in self.replicas]
        return [f.result() for f in futures]
