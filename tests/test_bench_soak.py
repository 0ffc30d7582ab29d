"""The soak benchmark's analysis (`tokenmill bench soak`): smaps parsing, resident pages of an address
range, growth after warm-up, and the idle trimmer, on synthetic data and this process's own memory."""

from __future__ import annotations

import mmap
import os
import platform

import pytest

from tokenmill.bench.soak import PAGE, growth, parse_smaps, resident_in, sample_process
from tokenmill.engine import memory_trim
from tokenmill.engine.memory_trim import HeapTrimmer, kv_pool_ranges, write_kv_pool_map

SMAPS = """\
55d0c0000000-55d0c4000000 rw-p 00000000 00:00 0                          [heap]
Size:              65536 kB
Rss:               40000 kB
Anonymous:         40000 kB
7f0000000000-7f0000100000 r-xp 00000000 08:01 1234                       /usr/lib/libc.so.6
Size:               1024 kB
Rss:                 800 kB
Anonymous:             0 kB
7f0000200000-7f0000300000 rw-p 00000000 00:00 0
Size:               1024 kB
Rss:                 512 kB
Anonymous:           512 kB
VmFlags: rd wr mr mw me ac sd
"""


def test_parse_smaps_reads_each_mapping():
    maps = parse_smaps(SMAPS)
    assert [(m.name, m.rss // 1024, m.anonymous // 1024) for m in maps] == [
        ("[heap]", 40000, 40000), ("/usr/lib/libc.so.6", 800, 0), ("", 512, 512)]
    assert maps[0].start == 0x55D0C0000000 and maps[0].end == 0x55D0C4000000


def test_growth_is_measured_from_the_end_of_warm_up():
    times = [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    # fast growth during warm-up (the first 20 s), then +3.5 MB on 400 MB; windows of 10 s
    values = [100, 300, 400, 401, 402, 401, 402, 403, 402, 403, 404]
    g = growth(times, values, 0.2)
    assert g["warm_mb"] == 400.5 and g["end_mb"] == 403.5 and g["peak_mb"] == 404
    assert g["growth_mb"] == 3 and g["growth_pct"] == pytest.approx(3 / 400.5 * 100)
    assert g["start_mb"] == 100
    leaking = growth(times, [400 + 3 * t for t in times], 0.2)
    assert leaking["growth_pct"] == pytest.approx((685 - 475) / 475 * 100)
    assert growth([0], [1.0], 0.2) is None
    assert growth([0, 1, 2], [1.0, 1.0, 1.0], 1.0) is None  # nothing after the warm-up to compare


def test_a_flat_saw_tooth_is_flat():
    # A trim every minute: troughs and peaks alternate around a level that does not move. Single
    # samples (a trough after warm-up, a peak at the end) would report +10%.
    times = list(range(0, 601, 5))
    values = [500 + (25 if (t // 30) % 2 else -25) for t in times]
    g = growth(times, values, 0.2)
    assert abs(g["growth_pct"]) < 1.0, g
    assert g["peak_mb"] == 525


def test_resident_pages_of_a_range_come_from_pagemap():
    size = 64 * PAGE
    buf = mmap.mmap(-1, size)  # anonymous, untouched: nothing resident yet
    try:
        import ctypes

        start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert resident_in(os.getpid(), [(start, start + size)]) == 0
        for i in range(0, size // 2, PAGE):  # touch the first half
            buf[i] = 1
        assert resident_in(os.getpid(), [(start, start + size)]) == size // 2
        assert resident_in(os.getpid(), [(start + size // 2, start + size)]) == 0
    finally:
        buf.close()


def test_sample_process_subtracts_the_kv_pool(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pool = [(torch.zeros(256 * 1024), torch.zeros(256 * 1024))]  # 2 MB, written: resident
    ranges = kv_pool_ranges(pool)
    assert [e - s for s, e in ranges] == [1024 * 1024, 1024 * 1024]
    assert kv_pool_ranges(pool * 3) == ranges  # layers sharing tensors (a hybrid KV cache) count once
    sample = sample_process(os.getpid(), ranges)
    assert sample["kv"] == pytest.approx(2.0, abs=0.02)
    assert sample["outside_kv"] == pytest.approx(sample["rss"] - sample["kv"])
    monkeypatch.setenv(memory_trim.KV_POOL_DIR_ENV, str(tmp_path))
    write_kv_pool_map(pool)
    written = (tmp_path / f"kv_pool-{os.getpid()}.json").read_text()
    assert str(ranges[0][0]) in written


def test_heap_trimmer_trims_once_per_busy_stretch(monkeypatch):
    calls = []
    monkeypatch.setattr(memory_trim, "malloc_trim", lambda: calls.append(1) or True)
    now = [100.0]
    trimmer = HeapTrimmer(clock=lambda: now[0])
    trimmer.update(False)
    assert calls == []  # idle from the start: nothing to give back
    trimmer.update(True)
    trimmer.update(False)
    trimmer.update(False)
    assert len(calls) == 1
    now[0] += 1.0  # busy again within MIN_TRIM_INTERVAL_S: the trim waits
    trimmer.update(True)
    trimmer.update(False)
    assert len(calls) == 1
    now[0] += memory_trim.MIN_TRIM_INTERVAL_S
    trimmer.update(False)
    assert len(calls) == 2 and trimmer.trims == 2


def test_heap_trimmer_trims_each_interval_under_steady_load(monkeypatch):
    calls = []
    monkeypatch.setattr(memory_trim, "malloc_trim", lambda: calls.append(1) or True)
    now = [0.0]
    trimmer = HeapTrimmer(clock=lambda: now[0])
    for _ in range(int(3.5 * memory_trim.BUSY_TRIM_INTERVAL_S)):  # a step a second, never idle
        trimmer.update(True)
        now[0] += 1.0
    assert len(calls) == 3


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_malloc_trim_is_found_in_glibc():
    assert memory_trim._glibc is not None
    memory_trim.malloc_trim()  # through ctypes, with the size_t argument declared
