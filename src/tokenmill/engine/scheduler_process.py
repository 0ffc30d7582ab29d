"""The scheduler process: one EngineCore behind zmq, for `tokenmill serve`.

Loop: drain every queued message (add / abort / finish) without blocking; step the engine when it has
work; otherwise block on the socket (with a timeout, to notice an orphaned parent). Token outputs go
to the detokenizer; admission errors and periodic stats go straight to the API server.

Run as `python -m tokenmill.engine.scheduler_process --ipc-dir D --config JSON`; the API server starts
it (entrypoints/openai/processes.py). It reports its limits in the start-up handshake (SchedulerReady).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import time
import traceback

import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import EngineCore, EngineOutput
from tokenmill.engine.engine_stats import kv_groups_list
from tokenmill.engine.memory_trim import HeapTrimmer, write_kv_pool_map
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.step_stats import DASHBOARD_STATS, PrefixTreeSummary
from tokenmill.errors import InvalidRequest
from tokenmill.ipc.channels import DETOKENIZER, MAIN, SCHEDULER, IpcPaths, Receiver, Sender, Undecodable
from tokenmill.ipc.lifecycle import child_process_setup, parent_alive, startup_failure
from tokenmill.ipc.messages import (
    AbortRequest,
    AddRequest,
    DetokenizeRequest,
    EmbeddingBatch,
    EmbeddingOutput,
    FinishRequest,
    Logprob,
    RequestFailed,
    SchedulerReady,
    SchedulerStats,
    TokenBatch,
    TokenOutput,
    ToScheduler,
)
from tokenmill.sample.logprobs import TokenLogprobs

logger = logging.getLogger(__name__)

# Stats go to the API server at most this often while busy, and once whenever the engine goes idle,
# so /metrics shows "nothing running, no KV in use" right after the last request ends. Four a second
# feed the live dashboard; one costs ~0.3 ms to build and encode with 264 requests (docs/benchmarks.md).
STATS_INTERVAL_S = 0.25
IDLE_POLL_MS = 1000


class SchedulerLoop:
    def __init__(self, engine: EngineCore, inbox: Receiver, to_detok: Sender, to_main: Sender) -> None:
        self.engine = engine
        self.inbox = inbox
        self.to_detok = to_detok
        self.to_main = to_main
        # Features that other parts of the engine add over time: detected, so the API server can say
        # "not supported" with a 400 instead of sending what the engine would ignore.
        self.supports_cache_salt = "cache_salt" in inspect.signature(engine.add_request).parameters
        self.supports_uncounted = "counted" in inspect.signature(engine.add_request).parameters
        self.supports_prompt_logprobs = "prompt_logprobs" in {f.name for f in dataclasses.fields(EngineOutput)}
        # Engine Request objects whose queue time is not reported yet: read at their first output
        # (the engine may already have dropped a request that finished in its first step).
        self._unreported: dict[str, Request] = {}
        self._last_stats = 0.0
        self._stats_dirty = True
        self._prefix_tree = PrefixTreeSummary()  # walks the radix tree every 2 s at most

    def run(self) -> None:
        trimmer = HeapTrimmer()  # freed heap back to the OS when idle, and each minute under load
        while True:
            busy = self.engine.has_unfinished()
            trimmer.update(busy)
            if busy or self.inbox.poll(IDLE_POLL_MS):
                for message in self.inbox.drain():
                    try:
                        self.handle(message)
                    except Exception:  # one bad message must not take the engine down for everyone
                        logger.exception("failed to handle %r", message)
            if self.engine.has_unfinished():
                self.step()
            self.maybe_send_stats()
            if not busy and not parent_alive():
                logger.warning("the API server is gone; scheduler exiting")
                return

    # ---- messages --------------------------------------------------------------------------
    def handle(self, message: ToScheduler | Undecodable) -> None:
        self._stats_dirty = True
        if isinstance(message, AddRequest):
            self.add(message)
        elif isinstance(message, AbortRequest):
            if self.engine.abort_request(message.request_id):
                # The detokenizer holds state for it: end that too (the API side already forgot it).
                self._emit([TokenOutput(message.request_id, [], True, "abort", None)])
            self._unreported.pop(message.request_id, None)
        elif isinstance(message, Undecodable):
            # Its sender waits for an answer: a request the API server passed on is failed with the
            # reason (a value its validation let through), never dropped to wait forever.
            if message.tag == "AddRequest" and message.request_id is not None:
                self.to_main.send(RequestFailed(message.request_id, f"invalid request: {message.error}", 400))
        elif isinstance(message, FinishRequest):
            request = self.engine.requests.get(message.request_id)
            if self.engine.finish_request(message.request_id, RequestStatus.FINISHED_STOPPED, message.stop_reason):
                # Its text ended already (a stop string); the timeline follows for the record.
                self._emit([TokenOutput(message.request_id, [], True, "stop", message.stop_reason,
                                        timeline=request.timeline.summary())])
            self._unreported.pop(message.request_id, None)

    def add(self, message: AddRequest) -> None:
        rid = message.request_id
        kwargs = {}
        if message.cache_salt is not None and self.supports_cache_salt:
            kwargs["cache_salt"] = message.cache_salt
        if message.internal and self.supports_uncounted:
            kwargs["counted"] = False
        try:
            if message.pooling is not None:  # an embedding: its one output goes straight to main
                self.engine.add_request(rid, message.prompt_token_ids, message.pooling)
                return
            self.engine.add_request(rid, message.prompt_token_ids, message.params, **kwargs)
        except InvalidRequest as exc:
            self.to_main.send(RequestFailed(rid, exc.message, 400, exc.param))
            return
        except Exception as exc:
            logger.exception("adding request %s failed", rid)
            self.to_main.send(RequestFailed(rid, f"internal error adding the request: {type(exc).__name__}", 500))
            return
        request = self.engine.requests.get(rid)
        if request is not None:
            self._unreported[rid] = request
        self.to_detok.send(DetokenizeRequest(rid, message.prompt_token_ids, message.params))

    # ---- stepping --------------------------------------------------------------------------
    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # an engine bug: fail what is in flight, keep serving, never hide it
            logger.exception("engine step failed; aborting every request in flight")
            self._fail_all(f"internal engine error: {traceback.format_exc(limit=1).strip()}")
            return
        embeddings = [EmbeddingOutput(out.request_id, out.embedding.numpy().astype("<f4").tobytes())
                      for out in outputs if out.embedding is not None]
        if embeddings:
            self.to_main.send(EmbeddingBatch(embeddings))
            outputs = [out for out in outputs if out.embedding is None]
        if outputs:
            self._emit([self._convert(out) for out in outputs])

    def _convert(self, out: EngineOutput) -> TokenOutput:
        queue_time = None
        request = self._unreported.pop(out.request_id, None)
        if request is not None:
            # Both clocks are read in this process: a duration, never a cross-process timestamp.
            queue_time = request.timeline.queue_time
        logprobs = [_wire(lp) for lp in out.new_logprobs] if out.new_logprobs else None
        prompt = getattr(out, "prompt_logprobs", None)
        return TokenOutput(
            out.request_id, out.new_token_ids, out.finished, out.finish_reason,
            out.stop_reason, logprobs, queue_time, getattr(out, "num_cached_tokens", 0),
            [None if lp is None else _wire(lp) for lp in prompt] if prompt is not None else None,
            out.timeline,
        )

    def _emit(self, outputs: list[TokenOutput]) -> None:
        self.to_detok.send(TokenBatch(outputs))

    def _fail_all(self, message: str) -> None:
        for rid in list(self.engine.requests):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("aborting %s after an engine fault failed", rid)
            self.to_main.send(RequestFailed(rid, message, 500))
            self._emit([TokenOutput(rid, [], True, "abort", None)])
        self._unreported.clear()

    def maybe_send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        idle = not self.engine.has_unfinished()
        if not (force or (self._stats_dirty and (idle or now - self._last_stats >= STATS_INTERVAL_S))):
            return
        s = self.engine.stats()
        self.to_main.send(SchedulerStats(
            num_requests_running=s.get("num_requests_running", 0),
            num_requests_waiting=s.get("num_requests_waiting", 0),
            kv_pages_total=s.get("kv_pages_total", 0),
            kv_pages_in_use=s.get("kv_pages_in_use", 0),
            prompt_tokens_total=s.get("prompt_tokens_total", 0),
            generation_tokens_total=s.get("generation_tokens_total", 0),
            prefix_cache_hit_tokens_total=s.get("prefix_cache_hit_tokens", s.get("prefix_cache_hit_tokens_total", 0)),
            num_preemptions=s.get("num_preemptions", 0),
            spec_decode_num_drafts_total=s.get("spec_decode_num_drafts_total", 0),
            spec_decode_num_draft_tokens_total=s.get("spec_decode_num_draft_tokens_total", 0),
            spec_decode_num_accepted_tokens_total=s.get("spec_decode_num_accepted_tokens_total", 0),
            spec_decode_num_emitted_tokens_total=s.get("spec_decode_num_emitted_tokens_total", 0),
            **{k: s[k] for k in DASHBOARD_STATS if k in s}, time_s=now,
            prefix_tree_top=self._prefix_tree.get(self.engine.scheduler.cache, now, fresh=idle),
            num_tokens=sum(r.num_tokens for r in self.engine.requests.values()),
            kv_cache_dtype=str(s.get("kv_cache_dtype", "")),
            kv_cache_bytes_per_token=int(s.get("kv_cache_bytes_per_token", 0)),
            kv_groups=kv_groups_list(s),
        ))
        self._last_stats = now
        self._stats_dirty = not idle


def _wire(lp: TokenLogprobs) -> Logprob:
    return Logprob(lp.token_id, lp.logprob, lp.rank, [tuple(t) for t in lp.top])


def model_name(config: EngineConfig) -> str:
    from tokenmill.model.default_model import default_model_path
    from tokenmill.model.gguf_parts import default_model_name

    return default_model_name(config.model or default_model_path())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="tokenmill scheduler process (started by `tokenmill serve`)")
    parser.add_argument("--ipc-dir", required=True)
    parser.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--replica", type=int, default=None, help="data-parallel replica index (logs only)")
    args = parser.parse_args(argv)
    name = "scheduler" if args.replica is None else f"scheduler-{args.replica}"
    child_process_setup(name, args.log_level, args.parent_pid)
    paths = IpcPaths(args.ipc_dir)
    ctx = zmq.Context()
    to_main = Sender(ctx, paths.address(MAIN))
    try:
        from tokenmill.engine.factory import build_engine_core

        config = EngineConfig.from_kwargs(**json.loads(args.config))
        inbox = Receiver(ctx, paths.address(SCHEDULER), ToScheduler, report_undecodable=True)
        to_detok = Sender(ctx, paths.address(DETOKENIZER))
        engine = build_engine_core(config)
        write_kv_pool_map(engine.runner.kv_caches)  # soak benchmarks: where the KV pool lives
        loop = SchedulerLoop(engine, inbox, to_detok, to_main)
        to_main.send(SchedulerReady(
            model_name=args.served_model_name or model_name(config),
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            kv_capacity_tokens=engine.scheduler.capacity_tokens,
            supports_cache_salt=loop.supports_cache_salt,
            supports_prompt_logprobs=loop.supports_prompt_logprobs,
            kv_capacity_note=getattr(engine.scheduler, "capacity_note", ""),
        ))
    except Exception as exc:
        to_main.send(startup_failure(logger, name, exc))
        time.sleep(0.5)  # LINGER is 0: give the message a moment to leave before the socket dies
        return 1
    try:
        loop.run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        engine.shutdown()  # tensor-parallel ranks stop with the engine; disk writes land
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
