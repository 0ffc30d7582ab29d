"""Ollama's reply fields: model, created_at, durations in nanoseconds, counts, and the model cards
of /api/tags, /api/ps and /api/show (whose family and architecture come from the model's files:
model/model_facts.py)."""

from __future__ import annotations

import contextvars
import datetime
import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.model.model_facts import ModelFacts, model_facts

# What /api/version reports: the Ollama API version whose fields these replies carry. Clients gate
# features on it (tools, think, structured format), so it is Ollama's number, not tokenmill's.
OLLAMA_API_VERSION = "0.12.0"

# Seconds this request waited for its model to load (set by the model router, model_routing.py;
# 0 with one model, loaded at start): Ollama's load_duration.
load_wait_s: contextvars.ContextVar[float] = contextvars.ContextVar("load_wait_s", default=0.0)


def created_at() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass
class Timing:
    """Where a request's time went, on the API process's clock (Ollama's *_duration fields)."""

    arrival: float
    first: float | None = None  # the first output came: the prompt was evaluated
    last: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def saw_output(self, num_output_tokens: int) -> None:
        now = time.monotonic()
        self.first = self.first or now
        self.last = now
        self.output_tokens = num_output_tokens

    def fields(self) -> dict[str, Any]:
        now = time.monotonic()
        first = self.first or now
        return {
            "total_duration": int((now - self.arrival) * 1e9),
            "load_duration": int(load_wait_s.get() * 1e9),
            "prompt_eval_count": self.prompt_tokens,
            "prompt_eval_duration": int((first - self.arrival) * 1e9),
            "eval_count": self.output_tokens,
            "eval_duration": int(((self.last or first) - first) * 1e9),
        }


def done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


class ModelCard:
    """A model this server serves, as Ollama's listings describe a model. `facts` is read from the
    files when not given (cached per file version; async callers read it in a thread first)."""

    def __init__(self, name: str, path: str, max_model_len: int, facts: ModelFacts | None = None) -> None:
        self.name = name
        self.path = path
        self.max_model_len = max_model_len
        self.facts = facts if facts is not None else model_facts(path)
        self.architecture = self.facts.architecture
        try:
            stat = os.stat(path)
            self.size = stat.st_size if os.path.isfile(path) else _folder_size(path)
            self.modified = datetime.datetime.fromtimestamp(stat.st_mtime, datetime.timezone.utc).isoformat()
        except OSError:
            self.size, self.modified = 0, created_at()
        # An identity, not a content hash (hashing gigabytes at start-up would cost seconds): it
        # changes when the file does.
        self.digest = hashlib.sha256(f"{os.path.abspath(path)}:{self.size}:{self.modified}".encode()).hexdigest()

    def names(self) -> tuple[str, ...]:
        return (self.name, f"{self.name}:latest")

    def details(self) -> dict[str, Any]:
        fmt = "gguf" if self.path.lower().endswith(".gguf") else "safetensors"
        count = self.facts.parameter_count
        return {"parent_model": "", "format": fmt, "family": self.architecture, "families": [self.architecture],
                "parameter_size": human_number(count) if count else "",
                "quantization_level": self.facts.quantization}

    def tag(self) -> dict[str, Any]:
        return {"name": f"{self.name}:latest", "model": f"{self.name}:latest", "modified_at": self.modified,
                "size": self.size, "digest": self.digest, "details": self.details()}

    def show(self, template: str, tools: bool, thinking: bool) -> dict[str, Any]:
        """/api/show's reply: `tools` / `thinking` when the server reads tool calls / reasoning."""
        capabilities = ["completion", "embedding"] + ["tools"] * tools + ["thinking"] * thinking
        info: dict[str, Any] = {"general.architecture": self.architecture}
        if self.architecture:
            info[f"{self.architecture}.context_length"] = self.max_model_len
        return {"modelfile": f"FROM {self.path}\n", "parameters": "", "license": "", "template": template,
                "details": self.details(), "modified_at": self.modified, "capabilities": capabilities,
                "model_info": info}

    def running(self) -> dict[str, Any]:
        # Loaded for as long as the server runs: expires far in the future, as Ollama shows keep_alive -1.
        return {**self.tag(), "expires_at": "2318-08-13T00:00:00Z", "size_vram": 0, "context_length": self.max_model_len}


def _folder_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def human_number(n: int) -> str:
    """A parameter count as Ollama writes it (its format.HumanNumber): "8B", "7.6B", "134.52M", "512K"."""
    for unit, scale, digits in (("B", 1e9, 1), ("M", 1e6, 2)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.{digits}f}{unit}"
    return f"{n / 1e3:.0f}K" if n >= 1000 else str(n)
