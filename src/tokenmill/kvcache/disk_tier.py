"""The prefix cache's second tier: KV pages in files on disk, found again by the tokens they hold.

Why: on a CPU a long prompt costs seconds to minutes to prefill, and the pool forgets it when the
radix tree evicts it or the server restarts. Every page the tree takes is also written here (write
through, by a writer thread, so the step never waits for the disk), and a prefix the tree no longer
holds is read back page by page instead of being recomputed (engine/kv_offload.py does both).

A page is a file named by its key, a hash of everything that decides its contents: the model's
identity, the KV layout and dtype, the page size, the cache salt and every token up to the page's
end (page_keys.py). The file holds a header (magic, key, the tensors' shapes and dtypes, a checksum of
the payload) and the payload. A file that is missing, truncated, of another layout, or whose checksum
fails is a miss: the caller recomputes, the file is removed, and one warning is logged per kind of
fault, so a corrupt tier can slow a request down but never serve wrong KV.

The tier is bounded in bytes (`max_bytes`), least recently used files first out. Its index (key ->
size, last use) lives in memory and is rebuilt from the folder at start-up, so it survives restarts;
files another process wrote meanwhile are simply not known until the next start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tokenmill.errors import InvalidRequest

logger = logging.getLogger(__name__)

MAGIC = b"TMKVPAGE1\n"
SUFFIX = ".kv"
# Header after the magic: key (32 bytes), checksum (16), then the layout string's length and itself.
_FIXED = struct.Struct("<32s16sI")
# get_many: pages read and checked on reader threads ahead of the one the caller takes. File reads
# and blake2b release the GIL, so two readers use both cores of a small machine while the engine
# waits for the prefix (a 4,096-token prefix is 255 pages, ~94 MB, on the bundled model).
READERS = 2
READ_AHEAD = 4


@dataclass
class TierStats:
    pages: int = 0
    bytes: int = 0
    writes: int = 0
    hits: int = 0
    misses: int = 0
    faults: int = 0  # reads that found a bad file (and recomputed)
    write_errors: int = 0  # writes that failed (full disk, permissions): those pages are not on disk
    evictions: int = 0


class DiskTier:
    def __init__(self, folder: str | os.PathLike, max_bytes: int, layout: str, page_bytes: int) -> None:
        """`layout` names what a page's payload is (its tensors' shapes and dtypes), `page_bytes` its
        size: a file of another layout or size is a miss."""
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidRequest(f"kv_cache_dir {self.folder} cannot be made: {exc.strerror}",
                                 param="kv_cache_dir") from exc
        self.max_bytes = max_bytes
        self.layout = layout.encode()
        self.page_bytes = page_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self._pending: set[bytes] = set()  # queued for writing, not yet on disk
        self._warned: set[str] = set()
        self._rebuild_index()
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        self._readers: ThreadPoolExecutor | None = None  # get_many's, started on first use

    # ---- the caller's side -----------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def put(self, key: bytes, payload: bytes) -> None:
        """Queues a page for writing. `payload` is a copy of the page (kept until written: that copy
        is the page's pin, so the pool page itself may be reused at once)."""
        with self._lock:
            if key in self._index or key in self._pending:
                return
            self._pending.add(key)
        self._queue.put((key, payload))

    def get(self, key: bytes) -> bytes | None:
        """The page's payload, or None (never on disk, evicted, or a bad file: recompute)."""
        return self._settle(key, self._try_read(key))

    def get_many(self, keys: list[bytes]) -> Iterator[bytes | None]:
        """get() of each key in order, the next READ_AHEAD files read and checked meanwhile on READERS
        threads. A caller stops at the first None (the rest of its prefix is recomputed): what was read
        ahead of it leaves no trace (counts, the LRU order and bad files are settled in order, as the
        caller takes each page)."""
        if self._readers is None:
            self._readers = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="kv-disk-reader")
        ahead: deque[tuple[bytes, Future[bytes | Exception | None]]] = deque()
        try:
            for key in keys:
                ahead.append((key, self._readers.submit(self._try_read, key)))
                if len(ahead) > READ_AHEAD:
                    first, future = ahead.popleft()
                    yield self._settle(first, future.result())
            while ahead:
                first, future = ahead.popleft()
                yield self._settle(first, future.result())
        finally:
            for _, future in ahead:
                future.cancel()

    def flush(self) -> None:
        """Waits until every queued page is on disk (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=10)
        if self._readers is not None:
            self._readers.shutdown(cancel_futures=True)

    # ---- files -----------------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def _try_read(self, key: bytes) -> bytes | Exception | None:
        """The page's checked payload, the error that reading it raised, or None where the index does
        not know the key; no side effects (reader threads run it ahead of the caller)."""
        with self._lock:
            if key not in self._index:
                return None
        try:
            return self._read(key)
        except (OSError, ValueError) as exc:
            return exc

    def _settle(self, key: bytes, result: bytes | Exception | None) -> bytes | None:
        """_try_read's result counted and acted on: a hit moves the key to the LRU end, a bad file
        is removed (one warning per kind of fault)."""
        if result is None:
            self._count("misses")
            return None
        if isinstance(result, FileNotFoundError):  # evicted by the writer meanwhile, or removed by hand
            self._forget(key)
            self._count("misses")
            return None
        if isinstance(result, Exception):
            self._fault(key, result)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self.stats.hits += 1
        return result

    def _read(self, key: bytes) -> bytes:
        data = self._path(key).read_bytes()
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _FIXED.size:
            raise ValueError("not a KV page file, or truncated in its header")
        stored_key, checksum, layout_len = _FIXED.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _FIXED.size
        layout = data[start:start + layout_len]
        payload = data[start + layout_len:]
        if stored_key != key:
            raise ValueError("the file holds another page")
        if layout != self.layout:
            raise ValueError("the file's KV layout differs from this engine's")
        if len(payload) != self.page_bytes or hashlib.blake2b(payload, digest_size=16).digest() != checksum:
            raise ValueError("checksum or size mismatch (truncated or corrupt)")
        return payload

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, payload: bytes) -> None:
        header = MAGIC + _FIXED.pack(key, hashlib.blake2b(payload, digest_size=16).digest(), len(self.layout))
        path = self._path(key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # data-parallel replicas may share the folder
        try:
            with open(tmp, "wb") as f:
                f.write(header + self.layout + payload)
            os.replace(tmp, path)  # readers never see half a file under the page's name
        except OSError as exc:
            with self._lock:
                self._pending.discard(key)
            self.stats.write_errors += 1
            self._warn_once("write", f"KV disk tier: cannot write pages to {self.folder} ({exc}); "
                                     "those prefixes will be recomputed when evicted")
            tmp.unlink(missing_ok=True)
            return
        size = len(header) + len(self.layout) + len(payload)
        with self._lock:
            self._pending.discard(key)
            self._index[key] = size
            self.stats.pages += 1
            self.stats.bytes += size
            self.stats.writes += 1
            victims = self._over_budget()
        for victim in victims:
            self._path(victim).unlink(missing_ok=True)

    def _over_budget(self) -> list[bytes]:
        """Drops least recently used entries until the tier fits its bound (with the lock held)."""
        victims = []
        while self.stats.bytes > self.max_bytes and self._index:
            victim, size = self._index.popitem(last=False)
            self.stats.bytes -= size
            self.stats.pages -= 1
            self.stats.evictions += 1
            victims.append(victim)
        return victims

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.stats.bytes -= size
                self.stats.pages -= 1

    def _count(self, name: str) -> None:
        """One more hit, miss or fault (reader threads count too)."""
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _fault(self, key: bytes, exc: Exception) -> None:
        self._forget(key)
        self._count("faults")
        self._path(key).unlink(missing_ok=True)
        self._warn_once(type(exc).__name__, f"KV disk tier: a page file in {self.folder} is unusable ({exc}); "
                                            "recomputing instead (further such faults are counted, not logged)")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message)

    def _rebuild_index(self) -> None:
        """The folder's page files, oldest use first (by modification time), within the bound."""
        entries = []
        for path in self.folder.glob("*" + SUFFIX):
            try:
                key = bytes.fromhex(path.name[: -len(SUFFIX)])
                st = path.stat()
            except (ValueError, OSError):
                continue
            entries.append((st.st_mtime_ns, key, st.st_size))
        for tmp in self.folder.glob("*.tmp"):  # a write cut short by a crash
            tmp.unlink(missing_ok=True)
        for _, key, size in sorted(entries):
            self._index[key] = size
            self.stats.pages += 1
            self.stats.bytes += size
        for victim in self._over_budget():
            self._path(victim).unlink(missing_ok=True)
