"""One call at a time on an offline `LLM`, and none after `shutdown`.

Why: a call drives the engine's step loop and takes the outputs of its own requests from it; two
threads stepping one engine took each other's outputs (a KeyError, an IndexError) and a call after
shutdown failed inside torch.distributed or an executor, differently per configuration. A call from
another thread now waits for the running one; a call from a thread that is itself inside a call (a
stream not read to its end) would wait for itself, so it is refused, as is any call after shutdown.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class CallGuard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self.closed = False

    @contextmanager
    def call(self) -> Iterator[None]:
        if self.closed:
            raise RuntimeError("this LLM was shut down; create a new one")
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError("this thread is already inside a call on this LLM (a stream not read to its end?): "
                               "finish or close it first")
        with self._lock:
            if self.closed:
                raise RuntimeError("this LLM was shut down; create a new one")
            self._owner = me
            try:
                yield
            finally:
                self._owner = None
