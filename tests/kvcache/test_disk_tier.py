"""The disk tier on its own: pages written by the writer thread and read back, its index rebuilt from
the folder (a restart), the byte bound, and the fault drills (a truncated file, a flipped byte, a
file of another layout, a full disk): each a miss, one warning, never wrong bytes."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from tokenmill.kvcache.disk_tier import DiskTier

PAGE = 64


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(PAGE))


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def tier(folder, max_bytes: int = 1 << 20, layout: str = "uint8(64,)") -> DiskTier:
    return DiskTier(folder, max_bytes, layout, PAGE)


def test_pages_round_trip_and_survive_a_restart(tmp_path):
    t = tier(tmp_path)
    for i in range(5):
        t.put(key(i), payload(i))
    t.flush()
    assert [t.get(key(i)) for i in range(5)] == [payload(i) for i in range(5)]
    assert t.get(key(99)) is None and t.stats.misses == 1
    t.close()
    again = tier(tmp_path)  # a new process: the index comes from the folder
    assert again.stats.pages == 5
    assert again.get(key(3)) == payload(3)
    again.close()


def test_the_byte_bound_evicts_least_recently_used(tmp_path):
    t = tier(tmp_path)
    t.put(key(0), payload(0))
    t.flush()
    size = t.stats.bytes
    t.close()
    t = tier(tmp_path, max_bytes=3 * size)
    for i in range(1, 3):
        t.put(key(i), payload(i))
    t.flush()
    assert t.get(key(0)) == payload(0)  # 0 is now the most recently used
    t.put(key(3), payload(3))
    t.flush()
    assert t.stats.bytes <= 3 * size and t.stats.evictions == 1
    assert t.get(key(1)) is None  # the least recently used went
    assert t.get(key(0)) == payload(0) and t.get(key(3)) == payload(3)
    assert len(list(tmp_path.glob("*.kv"))) == 3
    t.close()


def corrupt_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5])


def corrupt_flip(path):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))


def corrupt_header(path):
    path.write_bytes(b"garbage")


@pytest.mark.parametrize("corrupt", [corrupt_truncate, corrupt_flip, corrupt_header])
def test_a_damaged_file_is_a_miss_with_one_warning(tmp_path, caplog, corrupt):
    t = tier(tmp_path)
    for i in range(3):
        t.put(key(i), payload(i))
    t.flush()
    for i in range(2):
        corrupt(tmp_path / (key(i).hex() + ".kv"))
    with caplog.at_level(logging.WARNING):
        assert t.get(key(0)) is None and t.get(key(1)) is None
    assert t.get(key(2)) == payload(2)
    assert t.stats.faults == 2
    assert len([r for r in caplog.records if "unusable" in r.message]) == 1
    assert not (tmp_path / (key(0).hex() + ".kv")).exists()  # removed, so it is rewritten next time
    t.close()


def test_another_layout_never_matches(tmp_path):
    t = tier(tmp_path, layout="bfloat16(3, 16, 64)")
    t.put(key(0), payload(0))
    t.close()
    other = tier(tmp_path, layout="float32(3, 16, 64)")
    assert other.get(key(0)) is None and other.stats.faults == 1
    other.close()


def test_a_full_disk_loses_the_pages_not_the_engine(tmp_path, caplog, monkeypatch):
    t = tier(tmp_path)
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_disk)
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            t.put(key(i), payload(i))
        t.flush()
    assert t.stats.write_errors == 3 and t.stats.pages == 0
    assert not t.contains(key(0)) and t.get(key(0)) is None
    assert len([r for r in caplog.records if "cannot write" in r.message]) == 1
    assert not list(tmp_path.glob("*.tmp"))
    monkeypatch.undo()
    t.put(key(0), payload(0))  # room again: the page goes to disk
    t.flush()
    assert t.get(key(0)) == payload(0)
    t.close()


def test_reading_ahead_leaves_no_trace_past_where_the_caller_stops(tmp_path):
    t = tier(tmp_path)
    for i in range(12):
        t.put(key(i), payload(i))
    t.flush()
    bad = tmp_path / (key(2).hex() + ".kv")
    also_bad = tmp_path / (key(4).hex() + ".kv")
    for f in (bad, also_bad):
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    taken = []
    for p in t.get_many([key(i) for i in range(12)]):
        if p is None:
            break
        taken.append(p)
    assert taken == [payload(0), payload(1)]
    # page 2 settled as a fault (file removed); page 4, read ahead and as bad, is untouched and uncounted
    assert t.stats.faults == 1 and t.stats.hits == 2 and not bad.exists() and also_bad.exists()
    assert list(t.get_many([key(5), key(99), key(6)])) == [payload(5), None, payload(6)]
    assert t.stats.misses == 1
    t.close()
