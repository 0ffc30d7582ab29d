"""--tokenizer-workers' pool: workers give the thread's ids and errors, a crashed worker costs one
request a 500 and the pool recovers, and no worker outlives its server (closed, or killed -9)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tests.server.server_process import alive  # /proc's view: a zombie or a reaped pid is dead
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.chat_prompt_timing import timed_chat_prompt_ids
from tokenmill.frontend.tokenize_pool import TokenizePool, run_tokenizer
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.frontend.tokenizer_manager import RequestError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]


def _crash(tokenizer: Tokenizer) -> None:
    os._exit(3)  # a worker dying mid-request (killed by the OOM killer, a segfault in a native library)


def wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_pool_matches_thread_survives_a_crash_and_closes(smol_tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        pool = TokenizePool(1)
        manager = SimpleNamespace(tokenizer=smol_tokenizer, tokenize_pool=pool)
        thread_manager = SimpleNamespace(tokenizer=smol_tokenizer)
        (pid,) = await pool.start(smol_tokenizer)
        assert pid != os.getpid() and pool.pids() == [pid]

        text = "Ünïcode, spaces    and\n#### marks <|im_start|>"
        assert await run_tokenizer(manager, Tokenizer.encode, text) == await run_tokenizer(
            thread_manager, Tokenizer.encode, text) == smol_tokenizer.encode(text)
        ids, _ = await run_tokenizer(manager, timed_chat_prompt_ids, CHAT, 8192, add_generation_prompt=True)
        assert ids == smol_tokenizer.apply_chat_template(CHAT)

        with pytest.raises(InvalidRequest) as bad:  # a user error crosses the process boundary intact
            await run_tokenizer(manager, timed_chat_prompt_ids, [], 8192)
        assert bad.value.param == "messages"
        with pytest.raises(RequestError) as long:
            await run_tokenizer(manager, timed_chat_prompt_ids, [{"role": "user", "content": "x" * 900_000}], 8192)
        assert (long.value.status, long.value.code, long.value.param) == (400, "context_length_exceeded", "messages")

        with pytest.raises(RequestError) as died:
            await pool.run(_crash)
        assert (died.value.status, died.value.code) == (500, "tokenizer_worker_died")
        assert not wait_dead([pid])
        assert await pool.run(Tokenizer.encode, "again") == smol_tokenizer.encode("again")  # a new pool serves
        new_pids = pool.pids()
        assert new_pids and pid not in new_pids

        await pool.close()
        assert not wait_dead(new_pids)
        with pytest.raises(RequestError) as closed:
            await pool.run(Tokenizer.encode, "late")
        assert closed.value.status == 503

    asyncio.run(scenario())


SERVER_STANDIN = """
import asyncio, tokenizers
from tokenmill.frontend.tokenize_pool import TokenizePool
from tokenmill.frontend.tokenizer import Tokenizer

async def main():
    pool = TokenizePool(2)
    await pool.start(Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE())))  # tiny: loads at once
    print(*pool.pids(), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_workers_die_with_a_killed_server() -> None:
    """kill -9 of the process that owns the pool leaves no worker behind (PR_SET_PDEATHSIG)."""
    owner = subprocess.Popen([sys.executable, "-c", SERVER_STANDIN], stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline() if owner.stdout else ""
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2 and all(alive(p) for p in pids), line
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert not wait_dead(pids)
