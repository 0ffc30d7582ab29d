"""Waiting for the server's proof of life: text back from a real one-token request.

`/health` answers 200 only when text comes back through scheduler and detokenizer, not when the
processes merely exist: a scheduler stuck in a step or a detokenizer that stopped reading would
otherwise look healthy. Any request's text proves the loop turns, so a busy server passes at once
without waiting for the probe's own token. TokenizerManager sends the request (at start-up with no
timeout, since the first step may build kernels; for /health with one, shared between concurrent calls)
and this waits for the answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

POLL_S = 0.05


async def wait_for_text(stream: AsyncIterator, sent: float, timeout: float | None,
                        text_since: Callable[[float], bool], unhealthy: Callable[[], bool]) -> bool:
    """True once `stream` (the probe request's outputs) yields or any text arrived after `sent`; False
    when the server turns unhealthy, the probe fails, or `timeout` seconds pass first. Closes `stream`."""
    first = asyncio.ensure_future(anext(stream))
    try:
        while True:
            done, _ = await asyncio.wait({first}, timeout=POLL_S)
            if done:
                return first.exception() is None
            if text_since(sent):
                return True
            if unhealthy() or (timeout is not None and time.monotonic() - sent > timeout):
                return False
    finally:
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
