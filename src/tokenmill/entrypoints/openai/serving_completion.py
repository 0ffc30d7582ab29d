"""POST /v1/completions: text or token-id prompts (one or a batch), n samples each, optional echo.

Choice index = prompt index * n + sample index, as in OpenAI's API. Echo with logprobs scores the
prompt's tokens too (what lm-eval's loglikelihood tasks send, often with max_tokens 0: the prompt
alone comes back); vLLM's `prompt_logprobs` field is returned on the choices when asked for. Both
need an engine that computes prompt logprobs: the scheduler says in its handshake whether it does,
and if not such requests get a 400 rather than made-up numbers.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenmill.entrypoints.openai.errors import as_request_error
from tokenmill.entrypoints.openai.params import MAX_CHOICES, completion_sampling_params, echo_only
from tokenmill.entrypoints.openai.protocol import CompletionRequest
from tokenmill.entrypoints.openai.request_log import RequestRecord, record_of
from tokenmill.entrypoints.openai.serving_common import (
    DONE,
    SSE_HEADERS,
    Choice,
    ClientDisconnected,
    ServingBase,
    check_model,
    completion_logprobs,
    concat_logprobs,
    disconnected_response,
    json_response,
    new_id,
    now_s,
    parse_body,
    request_timing,
    sse,
    sse_error,
    stamp_last_byte,
    unless_disconnected,
    usage,
    vllm_prompt_logprobs,
    with_timing,
)
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.request_timelines import prompt_stages
from tokenmill.frontend.sequences import Seq, child_params
from tokenmill.frontend.tokenize_pool import check_length_bound, run_tokenizer
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.frontend.tokenizer_manager import RequestError
from tokenmill.ipc.messages import Logprob, TextOutput
from tokenmill.sample.sampling_params import SamplingParams


@dataclass(frozen=True)
class _Job:
    """What the response of one request needs besides the outputs."""

    request_id: str
    model: str
    params: SamplingParams
    prompts: list[tuple[str | None, list[int]]]  # (text or None, ids) per prompt
    echoes: list[str] | None  # prompt text per prompt, when echoing
    echo_only: bool  # max_tokens 0 with echo: the one sampled token is dropped
    prompt_logprobs_field: bool  # vLLM's `prompt_logprobs` on each choice

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.prompts)


class CompletionServing(ServingBase):
    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, CompletionRequest)
        self.manager.check_ready()
        limits, tok = self.manager.limits, self.manager.tokenizer
        assert limits is not None and tok is not None
        check_model(req.model, limits.model_name)
        params = completion_sampling_params(req)
        if params.prompt_logprobs is not None and not limits.supports_prompt_logprobs:
            raise InvalidRequest(
                "prompt logprobs (echo with logprobs, or prompt_logprobs) are not supported by this engine yet",
                param="prompt_logprobs" if req.prompt_logprobs is not None else "echo",
            )
        if isinstance(req.prompt, list) and len(req.prompt) * params.n > MAX_CHOICES and not _is_ids(req.prompt):
            raise InvalidRequest(f"at most {MAX_CHOICES} choices (prompts x n) per request", param="prompt")
        prompts = await run_tokenizer(self.manager, _tokenize, req.prompt, limits.max_model_len)
        stages = prompt_stages(time.monotonic())
        # A stream echoes each choice's prompt with that choice's first chunk: every sample then
        # brings its own prompt logprobs (otherwise only sample 0 computes them).
        seqs = [Seq(ids, child_params(params, k, bool(req.stream))) for _, ids in prompts for k in range(params.n)]
        self.manager.validate(seqs, "prompt")
        echoes = None
        if req.echo:
            echoes = [text if text is not None else tok.decode(ids, params.skip_special_tokens) for text, ids in prompts]
        job = _Job(new_id("cmpl"), limits.model_name, params, prompts, echoes, echo_only(req),
                   req.prompt_logprobs is not None)
        record = record_of(raw)
        record.request_id, record.prompt_tokens = job.request_id, job.prompt_tokens
        outputs = self.manager.generate(job.request_id, seqs, arrival=arrival, cache_salt=req.cache_salt,
                                        stages=stages)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            stream = self._stream(outputs, job, include_usage, record)
            if req.include_timing:
                head = {"id": job.request_id, "object": "text_completion", "created": now_s(), "model": job.model}
                stream = with_timing(stream, self.manager, job.request_id, head)
            stream = stamp_last_byte(stream, self.manager, job.request_id, arrival)
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            body = await unless_disconnected(raw, self._collect(outputs, job))
        except ClientDisconnected:
            return disconnected_response()
        record.set_usage(body["usage"])
        if req.include_timing:
            body["timing"] = await request_timing(self.manager, job.request_id)
        return json_response(body, self.manager, job.request_id, arrival)

    def _prompt_logprobs(self, job: _Job, prompt: int, items: list[Logprob | None] | None) -> dict[str, Any]:
        ids = job.prompts[prompt][1]
        return completion_logprobs(items or [None] * len(ids), self.texts, 0, ids, job.params.logprobs)

    async def _collect(self, outputs: AsyncIterator[tuple[int, TextOutput]], job: _Job) -> dict:
        n = job.params.n
        choices = [Choice() for _ in range(job.num_choices)]
        async for i, out in outputs:
            choices[i].add(out)
        if any(c.finish_reason == "abort" for c in choices):
            raise RequestError("the server aborted the request before it finished", 503)
        result = []
        for i, c in enumerate(choices):
            p = i // n
            prompt_lps = choices[p * n].prompt_logprobs  # sample 0 of the prompt computed them
            prefix = job.echoes[p] if job.echoes else ""
            text = "" if job.echo_only else "".join(c.text)
            logprobs = None
            if job.params.logprobs is not None:
                parts = [self._prompt_logprobs(job, p, prompt_lps)] if job.echoes else []
                if not job.echo_only:
                    parts.append(completion_logprobs(c.logprobs, self.texts, len(prefix)))
                logprobs = concat_logprobs(parts)
            choice = {"index": i, "text": prefix + text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if job.prompt_logprobs_field:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps or [], self.texts)
            result.append(choice)
        return {
            "id": job.request_id,
            "object": "text_completion",
            "created": now_s(),
            "model": job.model,
            "choices": result,
            "usage": usage(job.prompt_tokens, choices, n, count_completion=not job.echo_only),
        }

    async def _stream(
        self, outputs: AsyncIterator[tuple[int, TextOutput]], job: _Job, include_usage: bool, record: RequestRecord,
    ) -> AsyncIterator[str]:
        base = {"id": job.request_id, "object": "text_completion", "created": now_s(), "model": job.model}

        def chunk(index: int, text: str, logprobs: dict | None = None, finish: str | None = None,
                  stop_reason: int | str | None = None, **extra: Any) -> str:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, **extra}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            payload = {**base, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        n, want_logprobs = job.params.n, job.params.logprobs is not None
        choices = [Choice() for _ in range(job.num_choices)]
        offsets = [0] * job.num_choices  # characters sent per choice, for logprobs' text_offset
        started = [False] * job.num_choices
        try:
            async for i, out in outputs:
                choices[i].add(out, keep_text=False)
                if not started[i]:  # the echoed prompt (and its logprobs) leads the choice's stream
                    started[i] = True
                    prefix = job.echoes[i // n] if job.echoes else ""
                    offsets[i] = len(prefix)
                    extra = {}
                    if job.prompt_logprobs_field:
                        extra["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs or [], self.texts)
                    if prefix or extra:
                        lps = self._prompt_logprobs(job, i // n, out.prompt_logprobs) if want_logprobs and prefix else None
                        yield chunk(i, prefix, lps, **extra)
                if job.echo_only:
                    if out.finished:
                        yield chunk(i, "", None, out.finish_reason, out.stop_reason)
                    continue
                if not (out.text or out.logprobs or out.finished):
                    continue  # text held back (half a character, a possible stop string)
                logprobs = None
                if want_logprobs and out.logprobs:
                    logprobs = completion_logprobs(out.logprobs, self.texts, offsets[i])
                offsets[i] += len(out.text)
                yield chunk(i, out.text, logprobs, out.finish_reason if out.finished else None, out.stop_reason)
        except Exception as exc:  # includes RequestError: the stream ends as an error, never hangs
            record.set_usage(usage(job.prompt_tokens, choices, n, not job.echo_only))
            error = as_request_error(exc)
            for i, c in enumerate(choices):
                if c.finish_reason is None:
                    yield chunk(i, "", finish="abort")
            yield sse_error(error)
            yield DONE
            return
        final_usage = usage(job.prompt_tokens, choices, n, not job.echo_only)
        record.set_usage(final_usage)
        if include_usage:
            yield sse({**base, "choices": [], "usage": final_usage})
        yield DONE


def _tokenize(tokenizer: Tokenizer, prompt: str | list, max_model_len: int) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt, in the order the choices are numbered. Runs in a thread or
    a tokenizer worker (frontend/tokenize_pool.py); a text certainly too long is rejected untokenized."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if _is_ids(prompt):
        return [(None, list(prompt))]
    out: list[tuple[str | None, list[int]]] = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise InvalidRequest("the prompt is empty", param="prompt")
            check_length_bound(tokenizer, p, max_model_len, "prompt")
            out.append((p, tokenizer.encode(p)))
        else:
            out.append((None, list(p)))
    return out


def _is_ids(prompt: list) -> bool:
    return all(isinstance(t, int) for t in prompt)
