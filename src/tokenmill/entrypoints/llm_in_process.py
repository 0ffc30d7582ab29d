"""The offline API's one-engine body: `generate`, `chat`, `stream` over an EngineCore in this process.

It drives the same EngineCore as the server, in-process, and the same per-request output state
(detokenizer + stop strings) as the server's detokenizer, so there is one implementation of each.
`llm.py` puts the public `LLM` class on it; `llm_data_parallel.py` overrides its last step to spread
prompts over engine processes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.factory import build_engine_core
from tokenmill.engine.memory_trim import malloc_trim
from tokenmill.engine.request import RequestStatus
from tokenmill.entrypoints.llm_calls import CallGuard
from tokenmill.errors import InvalidRequest, is_int
from tokenmill.frontend.output_state import RequestOutputState
from tokenmill.frontend.outputs import CompletionOutput, RequestOutput
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.model.default_model import default_model_path
from tokenmill.pooling_params import PoolingParams
from tokenmill.sample.sampling_params import OutputKind, SamplingParams

PromptType = str | list[int] | dict[str, Any]
# Show a progress bar from this many prompts on; small calls stay quiet.
PROGRESS_BAR_MIN_PROMPTS = 16


class InProcessLLM:
    """The offline API over one engine in this process (what `LLM` is unless data_parallel_size > 1)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        self.engine: EngineCore = build_engine_core(self.config)
        self.tokenizer = Tokenizer.from_model_path(model or default_model_path())
        # Loading the tokenizer (model/tokenizer_export.load: no transformers here) leaves its parse
        # garbage as free but resident heap (the bundled model's ~31 MB; Gemma 3's 262k tokens and 515k
        # merges ~82 MB): give it back, as the server's processes do after their load
        # (docs/benchmarks.md, "Resident memory of LLM(file) without transformers").
        malloc_trim()
        self._ids = itertools.count()
        self._calls = CallGuard()

    # ---- public API ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        results = []
        for prompt in prompt_list:
            text, ids = self._tokenize(prompt)
            results.append(RequestOutput(str(next(self._ids)), text, ids))
        show = use_tqdm if use_tqdm is not None else len(prompt_list) >= PROGRESS_BAR_MIN_PROMPTS
        with self._calls.call():
            self._run(results, params_list, show)
        return results

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Each conversation rendered by the model's chat template and generated; with
        `continue_final_message` (and add_generation_prompt=False) the reply continues the final message."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.chat_prompt_ids(conv, add_generation_prompt, tools, chat_template_kwargs,
                                                      continue_final_message)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, chat_template_kwargs=chat_template_kwargs,
            continue_final_message=continue_final_message,
        )

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None) -> list[list[float]]:
        """One vector per prompt: the pooled final hidden state (the model's declared pooling, else
        the last token's), L2-normalised unless `pooling_params` says otherwise. The prompts run as
        embedding requests of the engine (engine/pooling.py): batched, prefill only, no KV kept."""
        params = pooling_params or PoolingParams()
        ids = [self._tokenize(p)[1] for p in _as_prompt_list(prompts)]
        rids = [f"embed-{next(self._ids)}" for _ in ids]
        vectors: dict[str, list[float]] = {}
        with self._calls.call(), _aborting(self.engine, rids):
            for rid, prompt_ids in zip(rids, ids):
                self.engine.add_request(rid, prompt_ids, params)
            while len(vectors) < len(rids):
                for out in self.engine.step():
                    if out.embedding is not None:
                        vectors[out.request_id] = out.embedding.tolist()
        return [vectors[rid] for rid in rids]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields the completion's text piece by piece as the engine produces it (one request)."""
        params = replace(sampling_params or SamplingParams(), output_kind=OutputKind.DELTA, n=1)
        text, ids = self._tokenize(prompt)
        request_id = f"stream-{next(self._ids)}"
        with self._calls.call(), _aborting(self.engine, [request_id]):
            self.engine.add_request(request_id, ids, params)
            state = RequestOutputState(request_id, self.tokenizer, ids, params)
            while True:
                for out in self.engine.step():
                    delta = self._apply(state, out)
                    if delta is not None and delta.text:
                        yield delta.text
                    if delta is not None and delta.finished:
                        return

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def reset_prefix_cache(self) -> bool:
        """Drops every unlocked cached page; True if the cache is now empty."""
        return self.engine.reset_prefix_cache()

    # ---- internals -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops the engine's other tensor-parallel ranks (nothing to do on one rank); also on `with`
        exit. Without it they stop when this process exits. Later calls raise RuntimeError."""
        self._calls.closed = True
        self.engine.shutdown()

    def __enter__(self) -> InProcessLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(is_int(t) for t in ids):
                    raise InvalidRequest("prompt_token_ids must be a list of integer token ids", param="prompt_token_ids")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        if isinstance(prompt, list) and all(is_int(t) for t in prompt):
            return None, list(prompt)
        raise InvalidRequest(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")

    def _run(self, results: list[RequestOutput], params_list: list[SamplingParams], show_progress: bool) -> None:
        states: dict[str, tuple[RequestOutputState, CompletionOutput]] = {}
        logprobs: dict[str, list] = {}
        cached: dict[str, int] = {}  # per prompt: the least any of its samples found in the cache
        try:
            for result, params in zip(results, params_list):
                for k in range(params.n):
                    # n samples of one prompt are n engine requests; with a seed, sample k uses seed + k
                    # (as vLLM does) so they differ yet stay reproducible. The engine prefills their
                    # shared prompt once. Prompt logprobs are the prompt's: sample 0 computes them.
                    child = replace(params, n=1, seed=None if params.seed is None else params.seed + k,
                                    output_kind=OutputKind.FINAL_ONLY,
                                    prompt_logprobs=params.prompt_logprobs if k == 0 else None)
                    rid = f"{result.request_id}-{k}"
                    self.engine.add_request(rid, result.prompt_token_ids, child)
                    completion = CompletionOutput(k, "", [], None)
                    result.outputs.append(completion)
                    states[rid] = (RequestOutputState(rid, self.tokenizer, result.prompt_token_ids, child), completion)
            pending = len(states)
            bar = tqdm(total=len(results), desc="generating", disable=not show_progress)
            left_per_result = {r.request_id: len(r.outputs) for r in results}
            by_id = {r.request_id: r for r in results}
            while pending:
                for out in self.engine.step():
                    state, completion = states[out.request_id]
                    parent = out.request_id.rsplit("-", 1)[0]
                    # The prompt counts once; its cached part is what was cached before it came, not
                    # what its samples then share with each other (they report more).
                    cached[parent] = min(cached.get(parent, out.num_cached_tokens), out.num_cached_tokens)
                    by_id[parent].num_cached_tokens = cached[parent]
                    if out.prompt_logprobs is not None:
                        by_id[parent].prompt_logprobs = out.prompt_logprobs
                    if out.new_logprobs:
                        logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
                    request = self.engine.requests.get(out.request_id)  # _apply may end it (a stop string)
                    delta = self._apply(state, out)
                    if delta is None or not delta.finished:
                        continue
                    timeline = out.timeline or (request.timeline.summary() if request is not None else None)
                    if by_id[parent].metrics is None or completion.index == 0:
                        by_id[parent].metrics = timeline
                    completion.text = delta.text
                    completion.token_ids = list(delta.token_ids)
                    completion.finish_reason = delta.finish_reason
                    completion.stop_reason = delta.stop_reason
                    if state.params.logprobs is not None:
                        # Tokens cut by a stop string are not returned, so neither are their logprobs.
                        completion.logprobs = logprobs.pop(out.request_id, [])[: delta.num_output_tokens]
                    pending -= 1
                    left_per_result[parent] -= 1
                    if left_per_result[parent] == 0:
                        by_id[parent].finished = True
                        bar.update(1)
            bar.close()
        finally:
            # An exception (or Ctrl-C) mid-run must not leave requests holding KV pages.
            for rid in states:
                self.engine.abort_request(rid)

    def _apply(self, state: RequestOutputState, out):
        delta = state.update(out.new_token_ids, out.finish_reason if out.finished else None)
        if delta is not None and delta.stop_hit and not out.finished:
            # A stop string ended it: stop generating now and give the KV back this step.
            self.engine.finish_request(out.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=delta.stop_reason)
        return delta


@contextmanager
def _aborting(engine: EngineCore, request_ids: list[str]) -> Iterator[None]:
    """Aborts the requests on the way out: an exception (or a stream left unread) mid-run must not
    leave requests holding KV pages."""
    try:
        yield
    finally:
        for rid in request_ids:
            engine.abort_request(rid)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(is_int(t) for t in prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequest(f"prompts must be a string, a list of token ids, a dict or a list of those, got "
                             f"{type(prompts).__name__}", param="prompts")
    if not prompts:
        raise InvalidRequest("no prompts given", param="prompts")
    return list(prompts)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidRequest(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}",
                             param="sampling_params")
    if len(params) != count:
        raise InvalidRequest(f"got {len(params)} sampling params for {count} prompts", param="sampling_params")
    return list(params)
