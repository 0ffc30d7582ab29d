"""Several models behind one server: which model a name means, and which loaded models must go.

Pure bookkeeping and policy (no processes, no sockets, no clock of its own: `now` is passed in), so
every rule is unit-tested alone; entrypoints/openai/model_pool.py owns the processes and applies it. The rules:

- A model is unloaded, loading, loaded or unloading. It loads on its first request.
- Before a load, loaded models are unloaded until the new one fits `max_loaded` (a count) and
  `max_memory` (bytes: each model's measured footprint, or its estimate before its first load):
  least recently used first, and never a model with requests in flight or still loading. When
  nothing idle is left to unload, the load waits (the caller retries when a request finishes).
- Before its first load a model's footprint is only its size on disk, and the real one is larger
  (KV pool, dequantized weights: ~2.7x for a Q4 Gemma-3). So once a load has measured it, if the
  resident total exceeds `max_memory`, idle loaded models unload, least recently used first, until
  it fits (`trim_to_memory`); never one with requests in flight, still loading, or the one just
  loaded. If nothing idle is left and it still does not fit, the pool logs a warning and serves on:
  the bound is then exceeded until a busy model goes idle and a later load trims again.
- An idle model unloads `idle_unload_s` after its last request finished, or at the deadline its
  last request's Ollama `keep_alive` set (0: as soon as that request finishes; negative, or longer
  than Go's durations reach, about 292 years: never).
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tokenmill.frontend.go_duration import parse_go_duration
from tokenmill.model.gguf_parts import all_parts, default_model_name, is_later_part


class ModelState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass
class ModelEntry:
    """One model the server can serve, loaded or not."""

    name: str
    path: str
    state: ModelState = ModelState.UNLOADED
    in_flight: int = 0  # requests routed to it that have not finished
    last_used: float = 0.0  # when its last request started or finished
    memory_bytes: int = 0  # measured while loaded; the estimate (file size) before its first load
    unload_at: float | None = None  # keep_alive's deadline for an idle model; None: the idle timeout
    loads: int = 0  # how many times it was loaded (/v1/models shows it: reloads are visible)
    load_seconds: float | None = None  # how long its last load took (processes up to a first token)

    @property
    def resident(self) -> bool:
        """Holds memory and processes: counted against the bounds."""
        return self.state in (ModelState.LOADING, ModelState.LOADED, ModelState.UNLOADING)


def model_name(path: str) -> str:
    """The name a model is served under when none is given (the scheduler's rule for
    --served-model-name's default: model/gguf_parts.py)."""
    return default_model_name(path)


def parse_model_arg(text: str) -> tuple[str, str]:
    """`--model NAME=PATH` or `--model PATH` -> (name, path). A path holding '=' needs the NAME= form."""
    name, sep, path = text.partition("=")
    if sep and name and "/" not in name and path:
        return name, path
    return model_name(text), text


# Go's time.Duration maximum (about 292 years): Ollama's "forever". A keep_alive as long or longer
# (1e12, 1e308) means forever too, rather than a deadline no clock can show (/api/ps's expires_at).
MAX_KEEP_ALIVE_S = (2**63 - 1) / 1e9
_KEEP_ALIVE_FORMS = "a number of seconds or a duration like '5m' or '1h30m'"


def keep_alive_seconds(value: object) -> float | None:
    """Ollama's keep_alive: seconds (a number) or a Go duration ("5m", "1h30m", "300ms", "0");
    negative or longer than Go can count: forever (-1). None when absent. Raises ValueError naming
    keep_alive on anything else, NaN and infinity included."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:  # a bare number ("300", "-1"): seconds, as a JSON number is; "nan" and "inf" are refused below
            seconds = float(text)
        except ValueError:
            try:
                seconds = parse_go_duration(text)
            except ValueError:
                raise ValueError(f"keep_alive must be {_KEEP_ALIVE_FORMS}, got {value!r}") from None
    else:
        raise ValueError(f"keep_alive must be {_KEEP_ALIVE_FORMS}, got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"keep_alive must be finite: {_KEEP_ALIVE_FORMS}, got {value!r}")
    return -1.0 if seconds >= MAX_KEEP_ALIVE_S else seconds


class Trim(NamedTuple):
    """What `trim_to_memory` decided: the models to unload, and whether the rest then fits."""

    victims: list[ModelEntry]
    fits: bool


class ModelRouter:
    """The table of models and the load/unload policy over it."""

    def __init__(self, entries: Sequence[ModelEntry], max_loaded: int | None = None,
                 max_memory: int | None = None, idle_unload_s: float | None = None) -> None:
        if not entries:
            raise ValueError("no model to serve")
        names = [e.name for e in entries]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ValueError(f"two models are named {duplicate!r}; give one another name with NAME=PATH")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1, got {max_loaded}")
        self.entries = {e.name: e for e in entries}
        self.default = entries[0].name  # a request that names no model gets the first one
        self.max_loaded = max_loaded
        self.max_memory = max_memory
        self.idle_unload_s = idle_unload_s

    def find(self, name: str | None) -> ModelEntry | None:
        """The model a request names (None: the default); Ollama's `NAME:latest` means NAME."""
        if name is None or name == "":
            return self.entries[self.default]
        found = self.entries.get(name)
        if found is None and name.endswith(":latest"):
            found = self.entries.get(name[: -len(":latest")])
        return found

    def resident(self) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.resident]

    # ---- requests -------------------------------------------------------------------------------
    def started(self, entry: ModelEntry, now: float) -> None:
        entry.in_flight += 1
        entry.last_used = now
        entry.unload_at = None

    def finished(self, entry: ModelEntry, now: float, keep_alive: float | None = None) -> None:
        if entry.in_flight <= 0:
            raise RuntimeError(f"model {entry.name!r}: a request finished that never started")
        entry.in_flight -= 1
        entry.last_used = now
        if keep_alive is not None:
            # Negative: stay loaded (until the bounds need the room); the latest request's wish wins.
            entry.unload_at = now + keep_alive if keep_alive >= 0 else float("inf")

    # ---- policy ---------------------------------------------------------------------------------
    def evictions(self, want: ModelEntry) -> list[ModelEntry] | None:
        """The loaded models to unload (least recently used first) so that `want` fits the bounds;
        [] if it fits already; None if it cannot fit until a busy model goes idle. A model bigger
        than max_memory on its own is loaded alone (an error would make it unusable)."""
        others = [e for e in self.resident() if e is not want]
        idle = sorted((e for e in others if self._evictable(e)), key=lambda e: e.last_used)
        chosen: list[ModelEntry] = []
        while not self._fits(want, [e for e in others if e not in chosen]):
            if not idle:
                return None
            chosen.append(idle.pop(0))
        return chosen

    def trim_to_memory(self, keep: ModelEntry) -> Trim:
        """After `keep` loaded and its footprint was measured: the idle loaded models to unload (least
        recently used first) so that the resident total fits max_memory, and whether it then does."""
        if self.max_memory is None:
            return Trim([], True)
        resident = self.resident()
        total = sum(e.memory_bytes for e in resident)
        idle = sorted((e for e in resident if e is not keep and self._evictable(e)), key=lambda e: e.last_used)
        victims = []
        while total > self.max_memory and idle:
            victim = idle.pop(0)
            victims.append(victim)
            total -= victim.memory_bytes
        return Trim(victims, total <= self.max_memory)

    def _fits(self, want: ModelEntry, staying: Iterable[ModelEntry]) -> bool:
        staying = list(staying)
        if self.max_loaded is not None and len(staying) + 1 > self.max_loaded:
            return False
        if self.max_memory is not None and staying:
            return sum(e.memory_bytes for e in staying) + want.memory_bytes <= self.max_memory
        return True

    @staticmethod
    def _evictable(entry: ModelEntry) -> bool:
        return entry.state is ModelState.LOADED and entry.in_flight == 0

    def expired(self, now: float) -> list[ModelEntry]:
        """Idle loaded models whose keep_alive deadline, or the idle timeout, has passed."""
        out = []
        for e in self.entries.values():
            if not self._evictable(e):
                continue
            if e.unload_at is not None:
                if now >= e.unload_at:
                    out.append(e)
            elif self.idle_unload_s is not None and now - e.last_used >= self.idle_unload_s:
                out.append(e)
        return out

    def next_deadline(self) -> float | None:
        """When the next idle model would expire (so the reaper sleeps until then)."""
        times = []
        for e in self.entries.values():
            if not self._evictable(e):
                continue
            if e.unload_at is not None:
                times.append(e.unload_at)
            elif self.idle_unload_s is not None:
                times.append(e.last_used + self.idle_unload_s)
        return min(times, default=None)


@dataclass(frozen=True)
class RouterConfig:
    """`tokenmill serve --model ... --model ...` / `--models-dir`: the models and the bounds."""

    models: tuple[tuple[str, str], ...]  # (name, path), in the order given; the first is the default
    max_loaded: int | None = None  # --max-loaded-models
    max_memory: int | None = None  # --max-memory, bytes
    idle_unload_s: float | None = None  # --idle-unload-seconds

    def router(self) -> ModelRouter:
        entries = [ModelEntry(name, path, memory_bytes=path_bytes(path)) for name, path in self.models]
        return ModelRouter(entries, self.max_loaded, self.max_memory, self.idle_unload_s)


def path_bytes(path: str) -> int:
    """A model's size on disk: the memory estimate before its first load measures the real one."""
    try:
        if os.path.isfile(path):  # a split model's first part: all its parts
            return sum(os.path.getsize(p) for p in all_parts(path) if os.path.isfile(p))
        return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
    except OSError:
        return 0


def models_in(directory: str) -> list[tuple[str, str]]:
    """`--models-dir`: every GGUF file (a split model once, by its first part) and every folder
    holding a config.json, sorted by name."""
    if not os.path.isdir(directory):
        raise ValueError(f"--models-dir {directory}: no such directory")
    found = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if is_later_part(path):  # a split model is listed once, by its first part
            continue
        if (os.path.isfile(path) and name.endswith(".gguf")) or os.path.isfile(os.path.join(path, "config.json")):
            found.append((model_name(path), path))
    if not found:
        raise ValueError(f"--models-dir {directory}: no GGUF file or model folder (with config.json) in it")
    return found


def parse_memory(text: str) -> int:
    """`--max-memory 8G` / `512M` / `1.5GiB` / bytes -> bytes (at least one; finite)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    body = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(body[-1:], 1)
    try:
        value = float(body[:-1] if body[-1:] in units else body) * scale
    except ValueError:
        raise ValueError(f"expected a size like 8G, 512M or a number of bytes, got {text!r}") from None
    if not math.isfinite(value):  # "inf", "1e400": int() would raise OverflowError, which argparse shows as a traceback
        raise ValueError(f"the memory bound must be a finite size like 8G, got {text!r}")
    if int(value) < 1:  # checked after rounding: 0.5 would otherwise be a 0-byte bound
        raise ValueError(f"the memory bound must be at least one byte, got {text!r}")
    return int(value)
