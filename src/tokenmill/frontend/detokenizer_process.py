"""The detokenizer process: token ids in, text out, stop strings found, for `tokenmill serve`.

One RequestOutputState per request (the same class the offline API uses), in DELTA mode. When a stop
string matches, the request's text ends here at once and a FinishRequest goes back to the scheduler,
which frees the KV within a step or two (tokens it produced meanwhile are dropped by the state). A
request's last text carries how long this process held it and how much of that it spent working
(durations: its clock is not the API server's).

The state table is bounded (MAX_STATES, SGLang's DETOKENIZER_MAX_STATES) but never evicts: losing a
live request's state loses its output (seed 001's failure). The API server's admission keeps live
requests below the bound (frontend/live_bound.py, checked at start-up); should a new request still
find the table full (aborted requests whose end has not reached here yet), that request is refused
with a 503 and every request already here keeps its state.

Run as `python -m tokenmill.frontend.detokenizer_process --ipc-dir D [--model PATH]`.
"""

from __future__ import annotations

import argparse
import logging
import time

import zmq

from tokenmill.engine.memory_trim import malloc_trim
from tokenmill.frontend.output_state import RequestOutputState
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.ipc.channels import DETOKENIZER, MAIN, SCHEDULER, IpcPaths, Receiver, Sender
from tokenmill.ipc.lifecycle import child_process_setup, parent_alive, startup_failure
from tokenmill.ipc.messages import (
    AbortRequest,
    DetokenizeRequest,
    DetokenizerReady,
    FinishRequest,
    Logprob,
    RequestFailed,
    TextBatch,
    TextOutput,
    ToDetokenizer,
    TokenOutput,
    ToScheduler,
)
from tokenmill.model.tokenizer_export import wait_for as wait_for_tokenizer

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
# Requests the table holds at most; the API server's admission bound must stay at or below it.
MAX_STATES = 65536


class _Seq:
    __slots__ = ("state", "logprobs", "sent_logprobs", "received", "busy")

    def __init__(self, state: RequestOutputState) -> None:
        self.state = state
        self.logprobs: list[Logprob] = []  # received, not yet sent
        self.sent_logprobs = 0
        # For the request's timeline: this process's clock, reported as durations (never as stamps).
        self.received = time.perf_counter()
        self.busy = 0.0  # seconds spent in state.update (detokenizing, stop strings)


class Detokenizer:
    """Pure message handling (no sockets), so tests can drive it directly."""

    def __init__(self, tokenizer: Tokenizer, max_states: int = MAX_STATES) -> None:
        self.tokenizer = tokenizer
        self.max_states = max_states
        self.seqs: dict[str, _Seq] = {}
        self.refused: list[RequestFailed] = []  # for the API server; run() sends and clears them

    def handle(self, message: ToDetokenizer) -> tuple[list[TextOutput], list[ToScheduler]]:
        """Text for the API server, and stop / abort orders for the scheduler."""
        if isinstance(message, DetokenizeRequest):
            if len(self.seqs) >= self.max_states:  # refuse the newcomer; never evict a live request
                logger.warning("detokenizer table full (%d requests): refusing %s", self.max_states,
                               message.request_id)
                self.refused.append(RequestFailed(
                    message.request_id, f"the server is overloaded: {self.max_states} requests are in flight; "
                    "retry later", 503))
                return [], [AbortRequest(message.request_id)]
            state = RequestOutputState(message.request_id, self.tokenizer, message.prompt_token_ids, message.params)
            self.seqs[message.request_id] = _Seq(state)
            return [], []
        texts: list[TextOutput] = []
        orders: list[ToScheduler] = []
        for out in message.outputs:
            try:
                self._apply(out, texts, orders)
            except Exception:  # a bug in one request's text must end that request, not this process
                logger.exception("detokenizing %s failed; aborting it", out.request_id)
                seq = self.seqs.pop(out.request_id, None)
                count = seq.state.num_output_tokens if seq is not None else 0
                texts.append(TextOutput(out.request_id, "", [], True, "abort", None, count))
                orders.append(AbortRequest(out.request_id))
        return texts, orders

    def _apply(self, out: TokenOutput, texts: list[TextOutput], orders: list[ToScheduler]) -> None:
        seq = self.seqs.get(out.request_id)
        if seq is None:  # its text already ended (stop string); these are the engine's last steps for it
            if out.timeline is not None:  # ... and the record of where its time went
                texts.append(TextOutput(out.request_id, "", [], True, out.finish_reason, out.stop_reason, 0,
                                        timeline=out.timeline))
            return
        if out.logprobs:
            seq.logprobs.extend(out.logprobs)
        tic = time.perf_counter()
        delta = seq.state.update(out.new_token_ids, out.finish_reason if out.finished else None)
        seq.busy += time.perf_counter() - tic
        if delta is None:  # DELTA mode answers every update that brings tokens or a finish
            return
        logprobs = None
        if seq.state.params.logprobs is not None:
            # Only tokens the state kept (none past a stop string) keep their logprobs.
            logprobs = seq.logprobs[: len(delta.token_ids)]
            del seq.logprobs[: len(delta.token_ids)]
        texts.append(TextOutput(
            out.request_id, delta.text, delta.token_ids, delta.finished, delta.finish_reason,
            delta.stop_reason, delta.num_output_tokens, logprobs, out.queue_time, out.num_cached_tokens,
            out.prompt_logprobs, out.timeline,
            {"held_s": time.perf_counter() - seq.received, "busy_s": seq.busy} if delta.finished else None,
        ))
        if delta.finished or out.finished:
            del self.seqs[out.request_id]
        if delta.stop_hit and not out.finished:
            reason = delta.stop_reason if isinstance(delta.stop_reason, str) else None
            orders.append(FinishRequest(out.request_id, reason))


def run(tokenizer: Tokenizer, inbox: Receiver, to_main: Sender, to_scheduler: Sender,
        max_states: int = MAX_STATES) -> None:
    detok = Detokenizer(tokenizer, max_states)
    while True:
        if not inbox.poll(IDLE_POLL_MS):
            if not parent_alive():
                logger.warning("the API server is gone; detokenizer exiting")
                return
            continue
        texts: list[TextOutput] = []
        for message in inbox.drain():
            new_texts, orders = detok.handle(message)
            texts.extend(new_texts)
            for order in orders:
                to_scheduler.send(order)
        if texts:
            to_main.send(TextBatch(texts))
        for refusal in detok.refused:
            to_main.send(refusal)
        detok.refused.clear()


def _load_tokenizer(tokenizer_file: str | None, model: str | None) -> Tokenizer:
    if tokenizer_file is not None:
        tokenizer = Tokenizer.from_files(wait_for_tokenizer(tokenizer_file, model or "", parent_alive))
        malloc_trim()  # parsing it leaves ~30 MB of freed heap resident (docs/benchmarks.md)
        return tokenizer
    from tokenmill.model.default_model import default_model_path

    return Tokenizer.from_model_path(model or default_model_path())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="tokenmill detokenizer process (started by `tokenmill serve`)")
    parser.add_argument("--ipc-dir", required=True)
    parser.add_argument("--model", default=None)
    # Written by the API server (model/tokenizer_export.py); waited for, so this process needs neither
    # transformers nor torch. Without it, the tokenizer is built here from --model.
    parser.add_argument("--tokenizer-file", default=None)
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--max-states", type=int, default=MAX_STATES, help="requests in flight at most")
    args = parser.parse_args(argv)
    child_process_setup("detokenizer", args.log_level, args.parent_pid)
    paths = IpcPaths(args.ipc_dir)
    ctx = zmq.Context()
    to_main = Sender(ctx, paths.address(MAIN))
    try:
        tokenizer = _load_tokenizer(args.tokenizer_file, args.model)
        inbox = Receiver(ctx, paths.address(DETOKENIZER), ToDetokenizer)
        to_scheduler = Sender(ctx, paths.address(SCHEDULER))
        to_main.send(DetokenizerReady())
    except Exception as exc:
        to_main.send(startup_failure(logger, "detokenizer", exc))
        time.sleep(0.5)  # LINGER is 0: give the message a moment to leave
        return 1
    try:
        run(tokenizer, inbox, to_main, to_scheduler, args.max_states)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
