"""The model router's pure policy (frontend/model_router.py): names, LRU unloading under the count
and memory bounds, in-flight protection, idle and keep_alive expiry. No processes, no clock."""

from __future__ import annotations

import pytest

from tokenmill.frontend.model_router import (
    ModelEntry,
    ModelRouter,
    ModelState,
    RouterConfig,
    keep_alive_seconds,
    models_in,
    parse_memory,
    parse_model_arg,
)

MB = 1 << 20


def loaded(name: str, last_used: float, memory: int = 100 * MB, in_flight: int = 0) -> ModelEntry:
    return ModelEntry(name, f"/m/{name}", ModelState.LOADED, in_flight, last_used, memory)


def test_names_and_arguments(tmp_path):
    assert parse_model_arg("chat=/models/a.gguf") == ("chat", "/models/a.gguf")
    assert parse_model_arg("/models/SmolLM2.Q4_1.gguf") == ("SmolLM2.Q4_1", "/models/SmolLM2.Q4_1.gguf")
    assert parse_model_arg("/models/x=y/folder/") == ("folder", "/models/x=y/folder/")  # '=' inside a path
    (tmp_path / "b.gguf").write_bytes(b"x")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-folder" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("no model")
    assert models_in(str(tmp_path)) == [("a-folder", str(tmp_path / "a-folder")), ("b", str(tmp_path / "b.gguf"))]
    with pytest.raises(ValueError, match="no GGUF file"):
        models_in(str(tmp_path / "a-folder"))
    router = RouterConfig((("a", str(tmp_path / "b.gguf")), ("b", str(tmp_path / "a-folder")))).router()
    assert router.entries["a"].memory_bytes == 1  # the file's size until a load measures it
    assert router.find(None).name == "a" and router.find("b:latest").name == "b" and router.find("c") is None
    with pytest.raises(ValueError, match="two models are named 'a'"):
        ModelRouter([ModelEntry("a", "/1"), ModelEntry("a", "/2")])


def test_a_split_model_is_listed_once_by_its_first_part_with_all_its_bytes(tmp_path):
    for no, size in ((1, 3), (2, 5), (3, 7)):
        (tmp_path / f"big-{no:05d}-of-00003.gguf").write_bytes(b"x" * size)
    (tmp_path / "small.gguf").write_bytes(b"x")
    first = str(tmp_path / "big-00001-of-00003.gguf")
    assert models_in(str(tmp_path)) == [("big", first), ("small", str(tmp_path / "small.gguf"))]
    assert parse_model_arg(first) == ("big", first)
    router = RouterConfig((("big", first),)).router()
    assert router.entries["big"].memory_bytes == 15  # every part


def test_keep_alive_and_memory_parsing():
    assert keep_alive_seconds(None) is None
    assert keep_alive_seconds(0) == 0 and keep_alive_seconds("0") == 0 and keep_alive_seconds(-1) == -1
    assert keep_alive_seconds("5m") == 300 and keep_alive_seconds("30s") == 30 and keep_alive_seconds("1.5h") == 5400
    # Go's durations, as Ollama reads a string keep_alive (time.ParseDuration)
    assert keep_alive_seconds("1h30m") == 5400 and keep_alive_seconds("2h45m30s") == 9930
    assert keep_alive_seconds("300ms") == pytest.approx(0.3) and keep_alive_seconds("-1m") == -60
    assert keep_alive_seconds("1m0.5s") == 60.5 and keep_alive_seconds("+.5h") == 1800 and keep_alive_seconds("-1") == -1
    assert keep_alive_seconds("1.h.5m") == 3630  # Go accepts a point with no digits on one side
    for bad in ("soon", True, [1], "", "h", ".s", "1h30", "5 m", "1d", "--1m"):
        with pytest.raises(ValueError, match="keep_alive"):
            keep_alive_seconds(bad)
    for bad in ("nan", "inf", "-Infinity", float("nan"), float("inf"), "1e400"):
        with pytest.raises(ValueError, match="keep_alive must be finite"):
            keep_alive_seconds(bad)
    # longer than any clock shows (Go's durations end at ~292 years): forever, as a negative one
    assert keep_alive_seconds(1e12) == -1 and keep_alive_seconds(1e308) == -1 and keep_alive_seconds("1e12") == -1
    assert keep_alive_seconds("9999999999h") == -1 and keep_alive_seconds(86400 * 365) == 86400 * 365
    assert parse_memory("8G") == 8 << 30 and parse_memory("512MiB") == 512 * MB and parse_memory("1000") == 1000
    assert parse_memory("1.5") == 1
    with pytest.raises(ValueError):
        parse_memory("lots")
    for bad, problem in (("inf", "finite"), ("1e400", "finite"), ("-inf", "finite"), ("nan", "finite"),
                         ("0.5", "at least one byte"), ("0", "at least one byte"), ("-1G", "at least one byte")):
        with pytest.raises(ValueError, match=problem):
            parse_memory(bad)


def test_lru_under_the_count_bound_skips_busy_and_loading_models():
    a, b, c = loaded("a", 1.0), loaded("b", 2.0, in_flight=1), loaded("c", 3.0)
    want = ModelEntry("d", "/m/d")
    router = ModelRouter([a, b, c, want], max_loaded=2)
    # two must go (3 resident + d > 2): a (oldest) and c; b has a request in flight
    assert router.evictions(want) == [a, c]
    c.state = ModelState.LOADING  # a model still loading is never unloaded either
    assert router.evictions(want) is None  # only a is idle: not enough room until b finishes
    router.finished(b, 4.0)
    assert router.evictions(want) == [a, b]


def test_memory_bound_unloads_least_recently_used_until_it_fits():
    a, b, c = loaded("a", 5.0, 300 * MB), loaded("b", 1.0, 300 * MB), loaded("c", 3.0, 300 * MB)
    want = ModelEntry("d", "/m/d", memory_bytes=400 * MB)
    router = ModelRouter([a, b, c, want], max_memory=1000 * MB)
    assert router.evictions(want) == [b]  # 600 + 400 fits
    want.memory_bytes = 700 * MB
    assert router.evictions(want) == [b, c]
    want.memory_bytes = 5000 * MB  # bigger than the bound alone: loaded alone rather than never
    assert router.evictions(want) == [b, c, a]
    y = ModelEntry("y", "/y")
    assert ModelRouter([loaded("x", 1.0), y]).evictions(y) == []  # no bound: everything stays


def test_trim_to_memory_after_a_load_measured_more_than_its_estimate():
    a, b, c = loaded("a", 1.0, 300 * MB), loaded("b", 2.0, 300 * MB, in_flight=1), loaded("c", 3.0, 300 * MB)
    new = loaded("new", 4.0, 600 * MB)  # admitted on its size on disk, measured bigger once loaded
    router = ModelRouter([a, b, c, new], max_memory=1000 * MB)
    assert router.trim_to_memory(new) == ([a, c], True)  # 1500 -> 900: LRU idle first, b is busy
    new.memory_bytes = 800 * MB
    assert router.trim_to_memory(new) == ([a, c], False)  # 1100 even so: the caller warns
    new.memory_bytes = 100 * MB
    assert router.trim_to_memory(new) == ([], True)
    assert ModelRouter([a, new]).trim_to_memory(new) == ([], True)  # no bound
    new.memory_bytes, new.in_flight = 2000 * MB, 0
    assert new not in router.trim_to_memory(new).victims  # never the model just loaded, idle or not


def test_requests_in_flight_protect_and_idle_expiry():
    a, b = loaded("a", 0.0), loaded("b", 0.0)
    router = ModelRouter([a, b], idle_unload_s=10.0)
    router.started(a, 1.0)
    assert router.expired(100.0) == [b]  # a is busy however old its last use
    router.finished(a, 50.0)
    assert router.expired(55.0) == [b] and router.expired(60.0) == [a, b]
    assert router.next_deadline() == 10.0
    with pytest.raises(RuntimeError, match="never started"):
        router.finished(a, 61.0)


def test_keep_alive_overrides_the_idle_timeout():
    a, b, c = loaded("a", 0.0), loaded("b", 0.0), loaded("c", 0.0)
    router = ModelRouter([a, b, c], idle_unload_s=None)
    for entry in (a, b, c):
        router.started(entry, 1.0)
    router.finished(a, 2.0, keep_alive=0)  # unload once this request is done
    router.finished(b, 2.0, keep_alive=-1)  # never on its own
    router.finished(c, 2.0, keep_alive=30)
    assert router.expired(2.0) == [a] and router.expired(40.0) == [a, c]
    router.started(a, 3.0)  # a new request cancels the deadline of the one before
    assert a.unload_at is None and router.expired(40.0) == [c]
    # an unloaded or unloading model never expires again
    c.state = ModelState.UNLOADING
    assert router.expired(40.0) == []


def test_serve_refuses_bad_model_lists_before_starting_anything(tmp_path, capsys):
    from tokenmill.entrypoints.cli import main

    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    cases = [
        (["--model", f"a={model}", "--model", f"a={model}"], "two models are named 'a'"),
        (["--model", f"a={model}", "--model", f"b={tmp_path / 'missing.gguf'}"], "no model at"),
        (["--models-dir", str(tmp_path / "none")], "no such directory"),
        (["--model", f"a={model}", "--model", f"b={model}", "--data-parallel-size", "2"], "not available"),
    ]
    for argv, message in cases:
        assert main(["serve", *argv]) == 2
        assert message in capsys.readouterr().err


def test_serve_refuses_a_memory_bound_that_is_not_a_positive_finite_size(tmp_path, capsys):
    from tokenmill.entrypoints.cli import main

    (tmp_path / "m.gguf").write_bytes(b"x")
    for bound in ("inf", "1e400", "0.5"):
        with pytest.raises(SystemExit) as done:
            main(["serve", "--models-dir", str(tmp_path), "--max-memory", bound])
        err = capsys.readouterr().err
        assert done.value.code == 2 and "argument --max-memory" in err and bound in err and "Traceback" not in err
