"""The data-parallel controller's wiring: N replicas (scheduler + detokenizer pairs) presented to the
TokenizerManager as if they were one scheduler.

The manager sends through `send()` and reads through `recv()`, exactly as it uses its single-engine
socket pair, so it stays unaware of replicas:

- send(AddRequest) asks the routing policy (frontend/dp_controller.py) for a live replica and records
  where the request went; the sequences of one request (`{id}-0`, `{id}-1`, ...: n > 1 samples) go
  to the same replica, so they share its prefill. Aborts and stops follow the request to its replica.
- Each replica's messages arrive on its own `main` socket (ipc/channels.py, IpcPaths.replica), so
  the sender is known without a field on the wire. The start-up handshakes are passed on once every
  replica has reported; stats are kept per replica (for /metrics and least_tokens) and passed on
  summed, so the manager's single view stays the server's total.
- A replica whose process exits is taken out of routing and its unfinished requests end with a 503
  (a RequestFailed made here), while the others keep serving; only when none is left does the
  manager learn of it and turn unhealthy.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq.asyncio

from tokenmill.frontend.dp_controller import PrefixAware, ReplicaLoad, make_policy
from tokenmill.ipc.channels import MAIN, SCHEDULER, AsyncReceiver, IpcPaths, Sender
from tokenmill.ipc.messages import (
    AbortRequest,
    AddRequest,
    DetokenizerReady,
    EmbeddingBatch,
    ProcessFailed,
    RequestFailed,
    SchedulerReady,
    SchedulerStats,
    TextBatch,
    ToMain,
    ToScheduler,
)

logger = logging.getLogger(__name__)

# Replicas chosen while serving the current HTTP request (a list the response-header middleware
# reads; entrypoints/openai/replica_header.py). A contextvar, so no handler has to pass it along.
routed_replicas: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("routed_replicas", default=None)

HISTORY = 1000  # finished sequences whose replica is remembered (as request_timelines keeps 1000)
# Gauges that describe a replica's present state; a dead replica reports zero for them.
_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_pages_in_use", "num_tokens")


@dataclass
class Replica:
    index: int
    inbox: AsyncReceiver
    sender: Sender
    live: bool = True
    ready: bool = False
    detokenizer_ready: bool = False
    stats: SchedulerStats | None = None
    tokens_since_stats: int = 0  # prompt tokens routed here after its last stats arrived
    rids: set[str] = field(default_factory=set)


def group_of(request_id: str) -> str:
    """The HTTP request a sequence belongs to: the manager names sequences `{request_id}-{i}`."""
    return request_id.rpartition("-")[0] or request_id


class DataParallelRouter:
    def __init__(self, ctx: zmq.asyncio.Context, paths: IpcPaths, size: int, method: str,
                 block_size: int = 16) -> None:
        self.method = method
        self.replicas = []
        for i in range(size):
            rpaths = paths.replica(i)
            self.replicas.append(Replica(i, AsyncReceiver(ctx, rpaths.address(MAIN), ToMain),
                                         Sender(ctx, rpaths.address(SCHEDULER))))
        self.policy = make_policy(method, size, block_size)
        # Told when no replica is left (the manager's on_process_exit: the server turns unhealthy).
        self.on_all_dead: Callable[[str, int], None] = lambda name, code: None
        self._queue: asyncio.Queue[ToMain] = asyncio.Queue()
        self._where: dict[str, int] = {}  # unfinished sequence -> replica
        self._groups: dict[str, tuple[int, int]] = {}  # request -> (replica, unfinished sequences)
        self._history: OrderedDict[str, int] = OrderedDict()
        self._started = False
        self._pumps = [asyncio.create_task(self._pump(r)) for r in self.replicas]

    @property
    def size(self) -> int:
        return len(self.replicas)

    @property
    def num_live(self) -> int:
        return sum(r.live for r in self.replicas)

    def replica_of(self, request_id: str) -> int | None:
        """Where a running or recently finished sequence was routed."""
        found = self._where.get(request_id)
        return found if found is not None else self._history.get(request_id)

    def loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(r.index, r.live, len(r.rids),
                            (r.stats.num_tokens if r.stats else 0) + r.tokens_since_stats) for r in self.replicas]

    # ---- the manager's sending side ------------------------------------------------------------
    def send(self, message: ToScheduler) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
            return
        index = self._where.get(message.request_id)
        if index is None:  # finished already, or never routed: nothing holds it
            return
        self.replicas[index].sender.send(message)
        self._done(message.request_id)

    def _add(self, message: AddRequest) -> None:
        rid, group = message.request_id, group_of(message.request_id)
        placed = self._groups.get(group)
        if placed is not None and self.replicas[placed[0]].live:
            index = placed[0]
        elif self.num_live == 0:
            raise RuntimeError("no data-parallel replica is alive")  # the manager is unhealthy by now
        else:
            index = self.policy.choose(message.prompt_token_ids, message.cache_salt, self.loads())
        replica = self.replicas[index]
        replica.sender.send(message)  # may raise (an unencodable value): then nothing is recorded
        replica.rids.add(rid)
        replica.tokens_since_stats += len(message.prompt_token_ids)
        self._where[rid] = index
        self._groups[group] = (index, (placed[1] if placed and placed[0] == index else 0) + 1)
        box = routed_replicas.get()
        if box is not None:
            box.append(index)
        logger.debug("request %s -> replica %d (%s)", rid, index, self.method)

    def _done(self, rid: str) -> None:
        index = self._where.pop(rid, None)
        if index is None:
            return
        self.replicas[index].rids.discard(rid)
        self._history[rid] = index
        if len(self._history) > HISTORY:
            self._history.popitem(last=False)
        group = group_of(rid)
        placed = self._groups.get(group)
        if placed is not None:
            if placed[1] <= 1:
                del self._groups[group]
            else:
                self._groups[group] = (placed[0], placed[1] - 1)

    # ---- the manager's receiving side ----------------------------------------------------------
    async def recv(self) -> ToMain:
        return await self._queue.get()

    async def _pump(self, replica: Replica) -> None:
        while True:
            try:
                message = await replica.inbox.recv()
            except asyncio.CancelledError:
                raise
            except Exception:  # as the manager's own loop: one bad message must not stop the rest
                logger.exception("undecodable message from replica %d", replica.index)
                continue
            for out in self._observe(replica, message):
                self._queue.put_nowait(out)

    def _observe(self, replica: Replica, message: ToMain) -> list[ToMain]:
        if isinstance(message, TextBatch):
            for out in message.outputs:
                if out.finished:
                    self._done(out.request_id)
        elif isinstance(message, EmbeddingBatch):
            for item in message.outputs:
                self._done(item.request_id)
        elif isinstance(message, RequestFailed):
            self._done(message.request_id)
        elif isinstance(message, SchedulerStats):
            replica.stats, replica.tokens_since_stats = message, 0
            return [self.total_stats()]
        elif isinstance(message, SchedulerReady):
            replica.ready = True
            return [message] if self._all_ready() else []
        elif isinstance(message, DetokenizerReady):
            replica.detokenizer_ready = True
            return [message] if self._all_ready("detokenizer_ready") else []
        elif isinstance(message, ProcessFailed):
            message = ProcessFailed(f"{message.process} (replica {replica.index})", message.error)
        return [message]

    def _all_ready(self, flag: str = "ready") -> bool:
        done = all(getattr(r, flag) for r in self.replicas)
        self._started = self._started or all(r.ready and r.detokenizer_ready for r in self.replicas)
        return done

    def total_stats(self) -> SchedulerStats:
        """Every replica's stats summed (the server's totals, what /metrics showed with one engine)."""
        stats = [r.stats for r in self.replicas if r.stats is not None]
        total = {}
        for name in SchedulerStats.__struct_fields__:
            values = [getattr(s, name) for s in stats]
            if name == "time_s":  # a clock reading (CLOCK_MONOTONIC is one clock for the machine)
                total[name] = max(values, default=0.0)
            elif values and isinstance(values[0], list):
                total[name] = [item for value in values for item in value]
            elif values and isinstance(values[0], str):  # a setting every replica shares (kv_cache_dtype)
                total[name] = values[0]
            elif name == "kv_cache_bytes_per_token":  # per token, not a count: the replicas' common value
                total[name] = max(values, default=0)
            else:
                total[name] = sum(values)
        return SchedulerStats(**total)

    def replica_stats(self) -> list[tuple[int, bool, SchedulerStats | None]]:
        return [(r.index, r.live, r.stats) for r in self.replicas]

    # ---- failures --------------------------------------------------------------------------------
    def on_process_exit(self, name: str, returncode: int) -> None:
        """ChildProcesses.watch's callback: `scheduler-i` or `detokenizer-i` exited."""
        base, _, suffix = name.rpartition("-")
        if not suffix.isdigit() or int(suffix) >= self.size:
            self.on_all_dead(name, returncode)
            return
        replica = self.replicas[int(suffix)]
        if not self._started:  # a replica that never came up fails the start, as one engine would
            self.on_all_dead(name, returncode)
            return
        if not replica.live:
            return
        replica.live = False
        if isinstance(self.policy, PrefixAware):
            self.policy.forget(replica.index)
        if replica.stats is not None:
            replica.stats = msgspec.structs.replace(replica.stats, **dict.fromkeys(_GAUGES, 0))
        reason = f"data-parallel replica {replica.index} failed: the {base} process exited with code {returncode}"
        logger.error("%s; %d request(s) on it end with an error, %d replica(s) still serve",
                     reason, len(replica.rids), self.num_live)
        for rid in sorted(replica.rids):
            # If only its detokenizer died, the scheduler would go on generating for nobody.
            replica.sender.send(AbortRequest(rid))
            self._queue.put_nowait(RequestFailed(rid, f"request ended: {reason}", 503))
            self._done(rid)
        self._queue.put_nowait(self.total_stats())
        if self.num_live == 0:
            self.on_all_dead(name, returncode)

    async def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
