"""The engine core: admission, one step (schedule → forward → sample → update), and KV reclaim.

It speaks token ids only. The offline `LLM`, the server's scheduler process and the tests all drive
this same class; text (detokenization, stop strings) is the frontend's business, which reports a
matched stop string back through `finish_request`.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.admission import check_prompt, resolve_max_tokens
from tokenmill.engine.engine_stats import engine_stats
from tokenmill.engine.kv_offload import KVOffload
from tokenmill.engine.pooling import add_pooled_parts, pooling_request
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.request_grammars import FAILED, RequestGrammars
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.scheduling_policy import make_policy
from tokenmill.engine.spec.proposer import Proposer, build_proposer, propose_drafts
from tokenmill.engine.spec.stats import SpecDecodeStats
from tokenmill.engine.step_stats import StepStats
from tokenmill.errors import InvalidRequest
from tokenmill.kvcache.page_pool import PagePool
from tokenmill.model.runner import ModelRunner, SeqChunk
from tokenmill.pooling_params import PoolingParams
from tokenmill.sample.logprobs import TokenLogprobs, prompt_logprobs
from tokenmill.sample.sampler import Sampler
from tokenmill.sample.sampling_params import SamplingParams
from tokenmill.sample.speculative import accepted_run, verification_batch

logger = logging.getLogger(__name__)


@dataclass
class EngineOutput:
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id (None for EOS)
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (page-aligned)
    # params.prompt_logprobs, first output only: one entry per prompt token, the first None (vLLM's shape)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    timeline: dict | None = None  # on the finished output: RequestTimeline.summary()
    # An embedding request's one output: its pooled final hidden state, fp32 [hidden] (engine/pooling.py)
    embedding: torch.Tensor | None = None


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        proposer: Proposer | None = None,
        pooling_type: str = "last",  # what the model's files declare (model/pooling.py), for embeddings
    ) -> None:
        self.config = config
        self.runner = runner
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.pooling_type = pooling_type
        self.pool = PagePool(config.num_pages, config.page_size)
        self.scheduler = Scheduler(
            self.pool, config.max_num_batched_tokens, config.max_num_seqs, config.enable_prefix_caching,
            make_policy(config.scheduling_policy), getattr(runner, "kv_layout", None),
        )
        if self.scheduler.prefix is not None:  # a match part way into a cached page copies it (fakes may not)
            self.scheduler.prefix.copy_page = getattr(runner, "copy_page", None)
        self.sampler = Sampler(vocab_size, sorted(self.eos_token_ids), seed=config.seed)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Prompt positions actually run through the model (recomputes included, cache hits not):
        # what prefix sharing saves shows here.
        self.prompt_tokens_computed_total = 0
        self.pooling_requests_total = 0  # embedding requests admitted
        # Structured output: each constrained request's grammar and matcher (engine/request_grammars.py).
        self.grammars = RequestGrammars(self._model_path, vocab_size, self.eos_token_ids)
        # Speculative decoding (engine/spec/): None when off.
        self.proposer: Proposer | None = build_proposer(config, vocab_size) if proposer is None else proposer
        self.spec_stats = SpecDecodeStats()
        self.step_stats = StepStats(config.max_num_batched_tokens)  # the dashboard's view of each step

    # ---- admission -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        cache_salt: str | None = None,
        counted: bool = True,
    ) -> None:
        """Validates and queues a request; raises InvalidRequest naming the problem. With
        PoolingParams it is an embedding request (engine/pooling.py).

        `cache_salt` picks the prefix-cache namespace: requests with different salts never share
        cached KV (tenant isolation); requests without one share the common space. `counted` False:
        the server's own health probe, left out of prompt_tokens_total / generation_tokens_total.
        """
        check_prompt(request_id, prompt_token_ids, cache_salt, self.requests, self.vocab_size)
        n_prompt = len(prompt_token_ids)
        if isinstance(params, PoolingParams):
            self._add_pooling(request_id, prompt_token_ids, params)
            return
        max_tokens = resolve_max_tokens(params, n_prompt, self.vocab_size, self.max_model_len,
                                        self.scheduler.capacity_tokens, self.config.scheduling_policy,
                                        self.scheduler.capacity_note)
        if params.structured_output is not None:
            self.grammars.submit(request_id, params.structured_output)
        request = Request(request_id, list(prompt_token_ids), params, max_tokens, cache_salt, counted=counted)
        # Same prompt and salt, same group: the scheduler prefills such requests once (n > 1).
        request.prefill_group = hash((cache_salt, tuple(prompt_token_ids)))
        self.requests[request_id] = request
        self.scheduler.add(request)
        if counted:
            self.prompt_tokens_total += n_prompt

    def _add_pooling(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams) -> None:
        capacity = self.scheduler.capacity_tokens
        request = pooling_request(request_id, prompt_token_ids, params, self.pooling_type, self.max_model_len, capacity)
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.prompt_tokens_total += len(prompt_token_ids)
        self.pooling_requests_total += 1

    def finish_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED, stop_reason: str | None = None
    ) -> bool:
        """Aborts (or, for a stop string the frontend found, stops) a request and releases its KV now.
        Unknown or already finished ids are ignored: a duplicate abort must be harmless."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.grammars.drop(request_id)
        request.stop_reason = stop_reason
        self.scheduler.finish(request, status)
        self._release_speculation(request_id)
        self._maybe_check_idle()
        return True

    def abort_request(self, request_id: str) -> bool:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _model_path(self) -> str:
        from tokenmill.model.default_model import default_model_path

        return os.path.abspath(os.path.expanduser(self.config.model or default_model_path()))

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        self.step_stats.begin()
        sched = self.scheduler.schedule()
        for r in sched.preempted:
            self._release_speculation(r.request_id)
            if r.pooled is not None:
                r.pooled.reset()  # it recomputes its prompt from position 0
        if not sched.chunks:
            return []
        self.num_steps += 1
        chunks = []
        drafts: dict[str, list[int]] = {}
        for c in sched.chunks:
            r = c.request
            start = r.num_computed_tokens
            known = c.num_tokens - c.num_drafts
            tokens = r.all_token_ids[start : start + known]
            if c.num_drafts:
                drafts[r.request_id] = r.spec_token_ids[: c.num_drafts]
                tokens = tokens + drafts[r.request_id]
            r.spec_token_ids = []  # used or dropped: the next proposal starts from what is accepted
            pooling_type = r.pooled.pooling_type if r.pooled is not None else None
            chunks.append(SeqChunk(tokens, start, r.pages, c.samples and pooling_type is None,
                                   all_logits=r.needs_prompt_logits, num_logits=1 + c.num_drafts,
                                   pooling_type=pooling_type, window_pages=r.window_pages or None))
            self.prompt_tokens_computed_total += max(0, min(start + known, r.num_prompt_tokens) - start)
        sampling = [c.request for c in sched.chunks if c.samples and c.request.pooled is None]
        pooled: list[torch.Tensor] = []
        if any(chunk.pooling_type is not None for chunk in chunks):
            logits, pooled = self.runner.execute_pooled(chunks)
        else:
            logits = self.runner.execute(chunks)
        if any(chunk.all_logits for chunk in chunks):
            logits = self._collect_prompt_logprobs(chunks, [c.request for c in sched.chunks], logits)
        for c in sched.chunks:
            # Draft positions count as computed only once accepted (below).
            c.request.num_computed_tokens += c.num_tokens - c.num_drafts
            if c.num_tokens > 1 and not c.num_drafts:
                c.request.timeline.add("prefill_chunk", tokens=c.num_tokens)
                # A prefill chunk: publish its full pages now, so requests admitted while this one
                # is still running share its prompt. Decode pages wait for the release.
                self.scheduler.cache_computed(c.request)
        outputs = self._finish_pooled(sched.chunks, chunks, pooled)
        outputs += self._sample_and_append(sampling, [drafts.get(r.request_id, []) for r in sampling], logits)
        self._propose()
        self._maybe_check_idle()
        self.step_stats.end(sched.chunks)
        return outputs

    def _finish_pooled(self, scheduled: list, chunks: list[SeqChunk], pooled: list[torch.Tensor]) -> list[EngineOutput]:
        """Embedding requests whose prompt this step completed end now ("stop"), their pages back
        in the pool, their vector the output."""
        outputs = []
        for r in add_pooled_parts([c.request for c in scheduled], chunks, pooled):
            self.requests.pop(r.request_id, None)
            self.scheduler.finish(r, RequestStatus.FINISHED_STOPPED)
            outputs.append(EngineOutput(r.request_id, [], True, r.finish_reason, timeline=r.timeline.summary(),
                                        embedding=r.pooled.result(r.num_prompt_tokens)))
        return outputs

    def _sample_and_append(
        self, sampling: list[Request], drafts: list[list[int]], logits: torch.Tensor
    ) -> list[EngineOutput]:
        """Samples every row (a request with k drafts has k + 1), accepts what the target agrees
        with (sample/speculative.py) and appends it, checking stops token by token."""
        if not sampling:
            return []
        matchers = None
        failed: list[EngineOutput] = []
        if self.grammars.active():
            matchers = self.grammars.rows(sampling)
            failed = [self._abort_failed_grammar(r) for r, m in zip(sampling, matchers) if m is FAILED]
            if failed:  # drop the rows of requests whose grammar failed to compile
                keep_req = [i for i, m in enumerate(matchers) if m is not FAILED]
                starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
                rows = [row for i in keep_req for row in range(starts[i], starts[i + 1])]
                logits = logits[torch.tensor(rows, dtype=torch.long)]
                sampling = [sampling[i] for i in keep_req]
                drafts = [drafts[i] for i in keep_req]
                matchers = [matchers[i] for i in keep_req]
                if not sampling:
                    return failed
        batch = verification_batch(
            [r.params for r in sampling],
            [r.params.seed for r in sampling],
            [r.prompt_token_ids for r in sampling],
            [r.output_token_ids for r in sampling],
            drafts,
            matchers,
        )
        sampled = self.sampler(logits, batch)
        token_ids = sampled.token_ids.tolist()
        outputs = failed
        row = 0
        for i, (request, guesses) in enumerate(zip(sampling, drafts)):
            run = accepted_run(token_ids[row : row + len(guesses) + 1], guesses)
            lps = sampled.logprobs[row : row + len(run)]
            row += len(guesses) + 1
            if guesses:
                # The K/V of the accepted drafts was written by this step's forward: it now counts.
                request.num_computed_tokens += len(run) - 1
            matcher = matchers[i] if matchers is not None else None
            status, emitted = self._append_run(request, run, matcher)
            if request.counted:
                self.generation_tokens_total += emitted
            if guesses:
                self.spec_stats.record(len(guesses), len(run) - 1, emitted)
            first = len(request.output_token_ids) == emitted
            if status is not None:
                self.grammars.drop(request.request_id)
                # A run cut short by a stop: K/V past the last kept token is not this request's.
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                self.requests.pop(request.request_id, None)
                self.scheduler.finish(request, status)
                self._release_speculation(request.request_id)
            elif guesses:
                self.scheduler.trim_pages(request)  # pages that held only rejected drafts
            kept_lps = [lp for lp in lps[:emitted] if lp is not None]
            outputs.append(
                EngineOutput(
                    request.request_id,
                    run[:emitted],
                    finished=status is not None,
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    new_logprobs=kept_lps or None,
                    num_cached_tokens=request.num_cached_tokens,
                    prompt_logprobs=request.prompt_logprobs if first else None,
                    timeline=request.timeline.summary() if status is not None else None,
                )
            )
        return outputs

    def _abort_failed_grammar(self, request: Request) -> EngineOutput:
        self.requests.pop(request.request_id, None)
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._release_speculation(request.request_id)
        return EngineOutput(request.request_id, [], finished=True, finish_reason=request.finish_reason)

    def _append_run(self, request: Request, run: list[int], matcher: Any) -> tuple[RequestStatus | None, int]:
        """Appends the step's tokens one by one until one ends the request: (its status, tokens kept)."""
        for emitted, token_id in enumerate(run, 1):
            request.append_output(token_id)
            status = self._check_stop(request, token_id)
            if matcher is not None:
                # The mask allowed only tokens the grammar accepts, so a refusal means the mask was
                # overridden (min_tokens hiding the only legal EOS): stop rather than run off-grammar.
                if not matcher.accept_token(token_id):
                    logger.warning("request %s: token %d refused by its grammar; stopping", request.request_id, token_id)
                    status = status or RequestStatus.FINISHED_STOPPED
                elif matcher.is_terminated():
                    # EOS was the only legal token (ignore_eos or not): the structure is complete.
                    status = status or RequestStatus.FINISHED_STOPPED
            if status is not None:
                return status, emitted
        return None, len(run)

    # ---- speculative decoding -------------------------------------------------------------------
    def _propose(self) -> None:
        spec = self.config.speculative
        if self.proposer is not None and spec is not None:
            propose_drafts(self.proposer, spec, self.scheduler.running, self.max_model_len, self.vocab_size)

    def _release_speculation(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.release(request_id)

    def _collect_prompt_logprobs(
        self, chunks: list[SeqChunk], requests: list[Request], logits: torch.Tensor
    ) -> torch.Tensor:
        """Scores the prompt tokens of `all_logits` chunks; returns the sampling rows only.

        The row of position q scores prompt token q + 1. Positions are filled in order: the prompt is
        computed from 0 without the cache (see PrefixAdmission.start), and a recompute after a
        preemption skips the positions already scored. Such a chunk costs a [its tokens, vocab] fp32
        logits tensor (400 MB for 2048 tokens of a 49k vocabulary), as in vLLM.
        """
        keep: list[int] = []
        row = 0
        for chunk, r in zip(chunks, requests):
            n = len(chunk.token_ids) if chunk.all_logits else chunk.num_logits if chunk.sample else 0
            if chunk.all_logits and r.prompt_logprobs is not None:
                done = len(r.prompt_logprobs) - 1  # positions already scored
                if chunk.start > done:
                    raise AssertionError(f"request {r.request_id!r}: prompt logprobs skipped positions")
                stop = min(chunk.start + n, r.num_prompt_tokens - 1)
                if stop > done:
                    rows = logits[row + done - chunk.start : row + stop - chunk.start]
                    targets = torch.tensor(r.prompt_token_ids[done + 1 : stop + 1])
                    r.prompt_logprobs.extend(prompt_logprobs(rows, targets, r.params.prompt_logprobs or 0))
            if chunk.sample:
                # A prompt chunk samples from its last row; a speculative chunk verifies with all its rows.
                keep.extend(range(row + n - chunk.num_logits, row + n))
            row += n
        return logits[torch.tensor(keep, dtype=torch.long)]

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.params
        n_out = len(request.output_token_ids)
        if n_out >= params.min_tokens:
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if n_out >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- accounting ----------------------------------------------------------------------------
    def _maybe_check_idle(self) -> None:
        # Cheap (O(pages + tree nodes)) and catches leaks at the moment they become visible.
        if not self.has_unfinished():
            # Large steps' weight copies live while requests run (an 8B's gate/up pair: 235-470 MB).
            self.runner.release_idle_memory()
            self.check_integrity()
            if self.proposer is not None:
                self.proposer.check_idle()
            cache = self.scheduler.cache
            idle = self.pool.num_free + self.scheduler.num_cached_pages
            if idle != self.pool.num_pages or (cache is not None and cache.num_locked_pages):
                raise AssertionError(f"engine idle but {self.pool.num_pages - idle} KV pages held by requests")

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def reset_prefix_cache(self) -> bool:
        """Evicts every cached page that no running request holds; True if the cache is now empty
        (benchmarks reset between repeats so that one run is not served from the previous one)."""
        cache = self.scheduler.cache
        if cache is None:
            return True
        cache.evict_all()
        return cache.num_pages == 0

    def stats(self) -> dict[str, int | float | str]:
        return engine_stats(self)

    def attach_disk_tier(self, offload: KVOffload) -> None:
        """The prefix cache's second tier (engine/kv_offload.py): pages the tree takes are written
        through to it, and matches continue on it where the tree's end."""
        if self.scheduler.cache is None:
            raise InvalidRequest("the KV disk tier extends the prefix cache, which is off (--no-prefix-caching)",
                                 param="kv_cache_dir")
        assert self.scheduler.prefix is not None
        self.scheduler.prefix.offload = offload
        self.scheduler.cache.on_insert = offload.on_insert

    def shutdown(self) -> None:
        """Stops the engine's other tensor-parallel ranks and waits for the disk tier's pending writes."""
        if self.scheduler.offload is not None:
            self.scheduler.offload.close()
        self.runner.shutdown()
