"""The API server's side of the control plane: admission against the scheduler's limits, the
request-state table (keyed by request id), routing outputs back to the waiting HTTP handlers, the
start-up handshake and the end-to-end health probe.

It lives on the server's event loop and talks to the scheduler and detokenizer processes over zmq.
It knows token ids, SamplingParams and text; HTTP and JSON are the entrypoint's business.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import zmq.asyncio

from tokenmill.engine.memory_trim import malloc_trim
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.health_probe import wait_for_text
from tokenmill.frontend.live_bound import check_live
from tokenmill.frontend.live_latency import LiveLatency
from tokenmill.frontend.output_merge import merge_pending
from tokenmill.frontend.request_error import RequestError
from tokenmill.frontend.request_limits import check_embedding_input, check_prompt
from tokenmill.frontend.request_timelines import PromptStages, TimelineRing, frontend_view
from tokenmill.frontend.sequences import Seq, SeqState
from tokenmill.frontend.server_status import MetricsSink, ServerStatus
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.ipc.channels import MAIN, SCHEDULER, AsyncReceiver, IpcPaths, Sender
from tokenmill.ipc.messages import (
    AbortRequest,
    AddRequest,
    DetokenizerReady,
    EmbeddingBatch,
    EmbeddingOutput,
    ProcessFailed,
    RequestFailed,
    SchedulerReady,
    SchedulerStats,
    TextBatch,
    TextOutput,
    ToMain,
)
from tokenmill.model.tokenizer_export import export as export_tokenizer
from tokenmill.model.tokenizer_export import handoff_path
from tokenmill.pooling_params import PoolingParams
from tokenmill.sample.sampling_params import OutputKind, SamplingParams

logger = logging.getLogger(__name__)

_EMBEDDING_PLACEHOLDER = SamplingParams(max_tokens=1)  # AddRequest's params, unused with `pooling`


def _ignore_result(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved


class TokenizerManager:
    # The probe of /health: a real one-token request must come back through scheduler and
    # detokenizer within this many seconds (SGLang's default).
    HEALTH_TIMEOUT_S = 20.0

    # Seconds an overloaded server asks a client to wait before retrying (Retry-After).
    RETRY_AFTER_S = 1

    def __init__(self, ctx: zmq.asyncio.Context, paths: IpcPaths, model_path: str, metrics: MetricsSink,
                 max_queued_requests: int | None = None, channels: tuple[Any, Any] | None = None,
                 chat_template: str | None = None) -> None:
        self.model_path = model_path
        self.chat_template = chat_template  # --chat-template: replaces the model's own
        # Where the tokenizer is exported for this process and the detokenizers (model/tokenizer_export.py).
        self.tokenizer_file = handoff_path(paths.directory)
        # Bound on sequences admitted but not yet producing output (waiting, or in prefill); None:
        # sized from the KV pool once the scheduler reports it (queued_bound).
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.status = ServerStatus.STARTING
        self.unhealthy_reason: str | None = None
        self.tokenizer: Tokenizer | None = None
        self.limits: SchedulerReady | None = None
        self.stats: SchedulerStats | None = None
        self.last_text_time = 0.0
        # channels: (recv, send) of a data-parallel router (frontend/dp_router.py) standing in for one scheduler
        self._inbox, self._to_scheduler = channels or (AsyncReceiver(ctx, paths.address(MAIN), ToMain),
                                                       Sender(ctx, paths.address(SCHEDULER)))
        self._states: dict[str, SeqState] = {}
        self._scheduler_ready = asyncio.Event()
        self._detokenizer_ready = asyncio.Event()
        self._startup_failed = asyncio.Event()
        self._health: asyncio.Task[bool] | None = None
        self._shutting_down = False
        self.draining = False  # set by drain(): new requests get 503, running ones may finish
        self.timelines = TimelineRing()  # recent finished sequences' stage times (request_timelines.py)
        self.tokenize_pool: Any = None  # --tokenizer-workers' TokenizePool (tokenize_pool.py); None: a thread
        self.live_bound: int | None = None  # most sequences live at once (live_bound.py; set at start-up)
        self.live = LiveLatency()  # the dashboard's sliding-window latencies (live_latency.py)
        self._recv_task = asyncio.create_task(self._recv_loop())

    # ---- start-up ----------------------------------------------------------------------------
    async def start(self, niceness: int = 0) -> bool:
        """Export the tokenizer (at `niceness`), wait for both children's handshake, push one request through."""
        model = os.path.abspath(os.path.expanduser(self.model_path))
        try:
            # Built in a child process (transformers imports torch; this process stays torch-free), which
            # also hands it to the detokenizers. A scheduler that fails meanwhile (a bad model file)
            # ends the wait: its reason is the one to report, not the export's.
            export = asyncio.ensure_future(asyncio.to_thread(export_tokenizer, model, self.tokenizer_file, niceness))
            failed = asyncio.ensure_future(self._startup_failed.wait())
            try:
                await asyncio.wait({export, failed}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # also when stopped by a signal meanwhile
                failed.cancel()
                if not export.done():  # the child ends by itself; nobody waits for it
                    export.add_done_callback(_ignore_result)
            if not export.done():
                return False
            files = export.result()
            self.tokenizer = await asyncio.to_thread(Tokenizer.from_files, files)
            malloc_trim()  # parsing it leaves ~30 MB of freed heap resident (docs/benchmarks.md)
            if self.chat_template is not None:
                self.tokenizer = self.tokenizer.with_chat_template(self.chat_template)
        except Exception as exc:
            self.mark_unhealthy(f"cannot load the tokenizer: {exc}")
            return False
        ready = asyncio.gather(self._scheduler_ready.wait(), self._detokenizer_ready.wait())
        failed = asyncio.ensure_future(self._startup_failed.wait())
        try:
            await asyncio.wait({ready, failed}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # stopped while starting (a signal): end both waits, quietly
            ready.cancel()
            failed.cancel()
            await asyncio.gather(ready, failed, return_exceptions=True)
            raise
        failed.cancel()
        if self.status is ServerStatus.UNHEALTHY:
            ready.cancel()
            await asyncio.gather(ready, return_exceptions=True)  # retrieved: no "never retrieved" log
            return False
        assert self.limits is not None
        logger.info("scheduler ready: model %s, context %d tokens, vocabulary %d, KV %d tokens%s",
                    self.limits.model_name, self.limits.max_model_len, self.limits.vocab_size,
                    self.limits.kv_capacity_tokens, f" a request ({self.limits.kv_capacity_note})"
                    if self.limits.kv_capacity_note else "")
        if not await self._probe(timeout=None):
            if self.status is not ServerStatus.UNHEALTHY:
                self.mark_unhealthy("the start-up request did not come back")
            return False
        if self.status is ServerStatus.STARTING:
            self.status = ServerStatus.UP
            logger.info("ready: a one-token request went through scheduler and detokenizer")
        return self.status is ServerStatus.UP

    def mark_unhealthy(self, reason: str) -> None:
        if self._shutting_down:
            return
        if self.status is not ServerStatus.UNHEALTHY:
            logger.error("server unhealthy: %s", reason)
            # The first reason is the cause; later ones (a process exiting because of it) are effects.
            self.unhealthy_reason = reason
        self.status = ServerStatus.UNHEALTHY
        self._startup_failed.set()
        for rid in list(self._states):
            self._fail(rid, RequestError(f"request ended: {reason}", 503, code="server_unhealthy"))

    def on_process_exit(self, name: str, returncode: int) -> None:
        if not self._shutting_down:
            self.mark_unhealthy(f"the {name} process exited with code {returncode}")

    async def drain(self, timeout: float) -> int:
        """Graceful shutdown, first half: refuse new requests (503) and give the running ones up to
        `timeout` seconds to finish; then abort the rest, each ending with a final output whose
        finish_reason is "abort" and then an error, so a stream still gets its last chunk, an error
        event and [DONE]. Returns how many sequences were aborted."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while any(s.record and not s.finished for s in self._states.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = [rid for rid, s in self._states.items() if not s.finished]
        error = RequestError(f"the server shut down before this request finished (drain timeout {timeout:g} s)",
                             503, code="server_shutting_down")
        for rid in left:
            state = self._states[rid]
            self._to_scheduler.send(AbortRequest(rid))
            state.finished = True
            state.queue.put_nowait((state.index, TextOutput(rid, "", [], True, "abort", None, state.num_output_tokens)))
            state.queue.put_nowait(error)
        if left:
            logger.warning("drain: %d request(s) still running after %g s were aborted", len(left), timeout)
        return len(left)

    async def shutdown(self) -> None:
        self._shutting_down = True
        for rid in list(self._states):
            self._fail(rid, RequestError("the server is shutting down", 503))
        self._recv_task.cancel()
        await asyncio.gather(self._recv_task, return_exceptions=True)

    # ---- requests ----------------------------------------------------------------------------
    def check_ready(self) -> None:
        if self.draining:
            raise RequestError("the server is shutting down; send the request to another server", 503,
                               code="server_shutting_down")
        if self.status is ServerStatus.STARTING:
            raise RequestError("the server is starting; retry when /health returns 200", 503)
        if self.status is ServerStatus.UNHEALTHY:
            raise RequestError(f"the server is unhealthy: {self.unhealthy_reason}", 503, code="server_unhealthy")

    def validate(self, seqs: Sequence[Seq], prompt_param: str, internal: bool = False) -> None:
        """Every check that needs the engine's limits, before anything is queued (same numbers as
        EngineCore.add_request, reported in the handshake). internal: the server's own probes, which
        also run while starting."""
        if not internal or self.status is ServerStatus.UNHEALTHY:
            self.check_ready()
        limits = self.limits
        if limits is None:
            raise RequestError("the scheduler has not reported its limits yet", 503)
        if not internal:
            self.check_queue(len(seqs), limits, prompt_param)
        for seq in seqs:
            check_prompt(seq.prompt_token_ids, seq.params, limits, prompt_param)

    def timeline(self, request_id: str) -> list[dict[str, Any]] | None:
        """Stage times of request `request_id`'s sequences: finished ones from the ring, running
        ones from their live state (engine view: not yet); None if no sequence is known."""
        found = []
        for i in itertools.count():
            seq_id = f"{request_id}-{i}"
            state = self._states.get(seq_id)
            record = self.timelines.get(seq_id)
            if record is None and state is not None and not state.finished:
                view = frontend_view(state.arrival, state.sent, state.first_time, state.last_time, state.stages)
                record = {"id": seq_id, "status": "running", "frontend": view, "engine": None}
            if record is None:
                break
            found.append(record)
        return found or None

    @property
    def num_queued(self) -> int:
        """Sequences admitted that have produced no output yet (waiting for, or in, their prefill)."""
        return sum(1 for s in self._states.values() if s.record and s.last_time is None and not s.finished)

    def queued_bound(self, limits: SchedulerReady) -> int:
        """--max-queued-requests, or by default what the KV pool holds at 64 tokens a request (at
        least 256): a queue longer than that would wait longer than its clients do."""
        return self.max_queued_requests or max(256, limits.kv_capacity_tokens // 64)

    def check_queue(self, new: int, limits: SchedulerReady, param: str) -> None:
        """Overload control: with the queue full, a new request gets 503 and Retry-After at once
        rather than a 200 whose first token comes after every request queued before it. A request
        that alone makes more sequences than the queue holds could never pass: 400, not a 503 a client
        would retry."""
        bound = self.queued_bound(limits)
        if new > bound:
            raise RequestError(f"{param}: this request makes {new} sequences (prompts x n), more than the {bound} "
                               "this server queues at once (--max-queued-requests); send it in parts", 400,
                               param=param)
        if self.num_queued + new > bound:
            self.metrics.observe_rejected("queue_full")
            raise RequestError(f"the server is overloaded: {self.num_queued} requests are queued and {bound} are the "
                               "most it takes; retry later", 503,
                               code="server_overloaded", headers={"Retry-After": str(self.RETRY_AFTER_S)})

    async def generate(
        self,
        request_id: str,
        seqs: Sequence[Seq],
        *,
        arrival: float,
        prompt_param: str = "prompt",
        cache_salt: str | None = None,
        internal: bool = False,
        stages: PromptStages | None = None,
    ) -> AsyncIterator[tuple[int, TextOutput]]:
        """Queue the seqs as engine requests `{request_id}-{i}` and yield (i, output) as text arrives.

        Leaving early (client disconnect, cancellation, an error) aborts every unfinished seq.
        """
        self.validate(seqs, prompt_param, internal)
        check_live(self, seqs, internal)  # never more live requests than the detokenizer holds
        queue: asyncio.Queue[tuple[int, TextOutput] | RequestError] = asyncio.Queue()
        rids = [f"{request_id}-{i}" for i in range(len(seqs))]
        if any(rid in self._states for rid in rids):
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        try:
            for i, (rid, seq) in enumerate(zip(rids, seqs)):
                self._states[rid] = SeqState(queue, i, arrival, not internal, stages)
                try:
                    self._to_scheduler.send(AddRequest(rid, seq.prompt_token_ids, seq.params, cache_salt,
                                                       internal=internal))
                    self._states[rid].sent = time.monotonic()
                except (OverflowError, msgspec.EncodeError) as exc:  # e.g. an integer beyond 64 bits
                    raise InvalidRequest(f"a request parameter is out of range: {exc}") from exc
            left = len(rids)
            while left:
                # A slow consumer (a client reading slowly) must not make the engine wait, and must not
                # receive a backlog of tiny chunks either: whatever piled up is merged into one output
                # per sequence before it is handed on.
                pending = [await queue.get()]
                while not queue.empty():
                    pending.append(queue.get_nowait())
                outputs, error = merge_pending(pending)
                for item in outputs:
                    if item[1].finished:
                        left -= 1
                    yield item
                if error is not None:
                    raise error
        finally:
            self._release(rids)

    async def embed(self, request_id: str, prompts: Sequence[list[int]], pooling: PoolingParams,
                    prompt_param: str = "input") -> list[bytes]:
        """Embedding requests `{request_id}-{i}`, one per prompt: their vectors (float32 bytes) in order.
        They never reach the detokenizer; leaving early aborts the unfinished ones."""
        self.check_ready()
        limits = self.limits
        assert limits is not None
        self.check_queue(len(prompts), limits, prompt_param)
        for ids in prompts:
            check_embedding_input(ids, limits, prompt_param)
        queue: asyncio.Queue = asyncio.Queue()
        rids = [f"{request_id}-{i}" for i in range(len(prompts))]
        vectors: list[bytes] = [b""] * len(rids)
        try:
            for i, (rid, ids) in enumerate(zip(rids, prompts)):
                self._states[rid] = SeqState(queue, i, time.monotonic(), False)
                self._to_scheduler.send(AddRequest(rid, list(ids), _EMBEDDING_PLACEHOLDER, pooling=pooling))
            left = len(rids)
            while left:
                item = await queue.get()
                if isinstance(item, RequestError):
                    raise item
                if isinstance(item[1], EmbeddingOutput):  # (a drain queues a TextOutput, then its error)
                    vectors[item[0]] = item[1].embedding
                    left -= 1
        finally:
            self._release(rids)
        return vectors

    # ---- health ------------------------------------------------------------------------------
    async def health(self) -> bool:
        if self.status is not ServerStatus.UP:
            return False
        if self._health is None or self._health.done():  # concurrent /health calls share one probe
            self._health = asyncio.create_task(self._probe(self.HEALTH_TIMEOUT_S))
        return await asyncio.shield(self._health)

    async def _probe(self, timeout: float | None) -> bool:
        """A real one-token request; True once text comes back (health_probe.py)."""
        tic = time.monotonic()
        params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=OutputKind.DELTA)
        token = self.tokenizer.bos_token_id if self.tokenizer and self.tokenizer.bos_token_id is not None else 0
        stream = self.generate(f"health-{time.monotonic_ns()}", [Seq([token], params)], arrival=tic, internal=True)
        return await wait_for_text(stream, tic, timeout, lambda sent: self.last_text_time > sent,
                                   lambda: self.status is ServerStatus.UNHEALTHY)

    # ---- receiving ---------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            try:
                message = await self._inbox.recv()
            except asyncio.CancelledError:
                raise
            except Exception:  # a malformed message must not stop the loop that serves everyone
                logger.exception("undecodable message on the API server's socket")
                continue
            try:
                self._dispatch(message)
            except Exception:
                logger.exception("failed to handle %s", type(message).__name__)

    def _dispatch(self, message: ToMain) -> None:
        if isinstance(message, TextBatch):
            self.last_text_time = now = time.monotonic()
            for out in message.outputs:
                state = self._states.get(out.request_id)
                if state is not None and not state.finished:
                    self._deliver(state, out, now)
                elif out.timeline is not None:  # the engine's last word on a text ended by a stop string:
                    self.timelines.engine(out.request_id, out.timeline)  # its record only (its count is 0)
        elif isinstance(message, EmbeddingBatch):
            for item in message.outputs:
                state = self._states.get(item.request_id)
                if state is not None:
                    state.finished = True
                    state.queue.put_nowait((state.index, item))
        elif isinstance(message, SchedulerStats):
            self.stats = message
        elif isinstance(message, RequestFailed):
            self._fail(message.request_id, RequestError(message.message, message.status, message.param))
        elif isinstance(message, SchedulerReady):
            self.limits = message
            self._scheduler_ready.set()
        elif isinstance(message, DetokenizerReady):
            self._detokenizer_ready.set()
        elif isinstance(message, ProcessFailed):
            self.mark_unhealthy(f"the {message.process} process failed: {message.error}")

    def _deliver(self, state: SeqState, out: TextOutput, now: float) -> None:
        if state.record:
            self.live.observe(out, now, state.arrival, state.last_time)
            if out.queue_time is not None:
                self.metrics.observe_queue_time(out.queue_time)
            n = len(out.token_ids)
            if n:
                if state.last_time is None:
                    self.metrics.observe_first_token(now - state.arrival)
                else:
                    self.metrics.observe_inter_token((now - state.last_time) / n, n)
                state.last_time = now
            if out.finished:
                self.metrics.observe_finished(now - state.arrival, out.finish_reason)
        state.num_output_tokens = out.num_output_tokens
        state.first_time = state.first_time or now
        if out.finished:
            state.finished = True
            if state.record:
                view = frontend_view(state.arrival, state.sent, state.first_time, now, state.stages)
                self.timelines.finished(view, out, state.stages)
        state.queue.put_nowait((state.index, out))

    def _release(self, rids: Sequence[str]) -> None:
        """Forget the seqs of a request that is over for its caller; abort those still running (counted
        as finished for "abort", as vLLM counts them)."""
        for rid in rids:
            state = self._states.pop(rid, None)
            if state is not None and not state.finished:
                self._to_scheduler.send(AbortRequest(rid))
                if state.record:
                    self.metrics.observe_finished(time.monotonic() - state.arrival, "abort")

    def _fail(self, rid: str, error: RequestError) -> None:
        state = self._states.get(rid)
        if state is not None:
            state.queue.put_nowait(error)
