"""zmq PUSH/PULL channels over ipc:// sockets in one temp directory, carrying msgspec structs.

Each process binds the one PULL socket it reads and connects PUSH sockets to the others; zmq queues
messages sent before the peer has bound (ipc reconnects), so start-up order does not matter.
PUSH/PULL has no reply and no flow control: a send only means "queued". Liveness is the supervisor's
business (process exit codes), never a blocking send, hence unlimited high-water marks.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

SCHEDULER, DETOKENIZER, MAIN = "scheduler", "detokenizer", "main"


@dataclass(frozen=True)
class IpcPaths:
    directory: str

    @classmethod
    def create(cls) -> IpcPaths:
        # Unix socket paths are limited to ~107 bytes: keep the directory short.
        return cls(tempfile.mkdtemp(prefix="tokenmill-"))

    def address(self, process: str) -> str:
        return f"ipc://{os.path.join(self.directory, process)}"

    def replica(self, index: int) -> IpcPaths:
        """Data-parallel replica `index`'s own directory: its scheduler and detokenizer talk over the
        same socket names as a single engine does, and its messages to the API server arrive on that
        directory's own `main` socket, which is how the server knows which replica sent them."""
        path = os.path.join(self.directory, f"r{index}")
        os.makedirs(path, exist_ok=True)
        return IpcPaths(path)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)  # never keep a dying process alive to flush messages nobody reads


_encoder = msgspec.msgpack.Encoder()


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


@dataclass(frozen=True)
class Undecodable:
    """A message that arrived but is not its channel's type (a field of the wrong type, a value its
    struct's validation refuses): what could still be read of it, so that the request it carried can
    be failed with the reason instead of waiting for an answer that never comes."""

    tag: str | None  # the struct's tag ("AddRequest"), when the message is a map that has one
    request_id: str | None
    error: str  # msgspec's message: what is wrong, and where ("... - at `$.prompt_token_ids[0]`")


class Receiver:
    """A blocking PULL socket (child processes) decoding one union type. `report_undecodable`: drain()
    returns an Undecodable in place of a message that does not decode, instead of dropping it."""

    def __init__(self, ctx: zmq.Context, address: str, message_type: Any, report_undecodable: bool = False) -> None:
        self.sock = ctx.socket(zmq.PULL)
        _configure(self.sock)
        self.sock.bind(address)
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._report = report_undecodable

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def drain(self) -> list[Any]:
        """Everything queued now, without blocking. An undecodable message is logged, and dropped or
        reported: the loop that serves every other request must keep turning."""
        messages = []
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            try:
                messages.append(self._decoder.decode(data.buffer))
            except msgspec.DecodeError as exc:
                logger.exception("undecodable message (%d bytes)", len(data.buffer))
                if self._report:
                    messages.append(_undecodable(data.buffer, exc))


def _undecodable(buffer: Any, exc: msgspec.DecodeError) -> Undecodable:
    try:
        raw = msgspec.msgpack.decode(buffer)
    except msgspec.DecodeError:  # not even msgpack
        raw = None
    fields = raw if isinstance(raw, dict) else {}
    tag, rid = fields.get("type"), fields.get("request_id")
    return Undecodable(tag if isinstance(tag, str) else None, rid if isinstance(rid, str) else None, str(exc))


class Sender:
    """A PUSH socket (blocking or asyncio context alike: sends never wait with unlimited HWM)."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        _configure(self.sock)
        self.sock.connect(address)

    def send(self, message: Any) -> None:
        # zmq.asyncio sockets return a future from send(); with no HWM it is already done, so the
        # same non-async call serves both the children's loops and the API server's event loop.
        self.sock.send(encode(message), copy=False)


class AsyncReceiver:
    """The API server's PULL socket, read from its event loop."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, message_type: Any) -> None:
        self.sock = ctx.socket(zmq.PULL)
        _configure(self.sock)
        self.sock.bind(address)
        self._decoder = msgspec.msgpack.Decoder(message_type)

    async def recv(self) -> Any:
        data = await self.sock.recv(copy=False)
        return self._decoder.decode(data.buffer)
