"""What a model's files say about it without loading it: its architecture, context length and chat
template, read torch-free (GGUF metadata: model/gguf_metadata.py; a folder's config.json and
tokenizer files).

Why: Ollama's /api/tags and /api/show describe models the multi-model server has not loaded, and
must not load one just to describe it (a load may unload another model). Read once per file
version (keyed by model/file_stamp.py) and in a thread by async callers: a large vocabulary makes
the metadata megabytes long.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any

from tokenmill.model.file_stamp import FileStamp, file_stamp


@dataclass(frozen=True)
class ModelFacts:
    architecture: str  # GGUF general.architecture, config.json model_type; "" when unknown
    context_length: int | None = None  # what the model was trained for; None when unknown
    chat_template: str | None = None
    parameter_count: int | None = None  # a GGUF's weights, from its tensor table; None when not read
    quantization: str = ""  # a GGUF's general.file_type by llama.cpp's name ("Q4_K_M"); "" when unknown


UNKNOWN = ModelFacts("")


def model_facts(path: str) -> ModelFacts:
    """The model's facts; UNKNOWN for a path that is missing or cannot be read (loading it says why)."""
    return _read(os.path.abspath(path), file_stamp(path))


@functools.lru_cache(maxsize=64)
def _read(path: str, stamp: FileStamp) -> ModelFacts:
    if stamp is None:
        return UNKNOWN
    try:
        return _folder(path) if os.path.isdir(path) else _gguf(path)
    except Exception:  # a broken file is described as unknown; a load reports its cause
        return UNKNOWN


def _gguf(path: str) -> ModelFacts:
    from tokenmill.model.gguf_metadata import read_gguf_metadata_and_parameters

    meta, parameters = read_gguf_metadata_and_parameters(path)
    arch = str(meta.get("general.architecture", ""))
    template = meta.get("tokenizer.chat_template")
    return ModelFacts(arch, _positive_int(meta.get(f"{arch}.context_length")),
                      template if isinstance(template, str) else None, parameters,
                      _file_type_name(meta.get("general.file_type")))


def _file_type_name(value: Any) -> str:
    """llama.cpp's name of a general.file_type ("Q4_K_M", "F16"); "" for none or one gguf-py does not know."""
    from gguf import LlamaFileType

    try:
        name = LlamaFileType(int(value)).name
    except (TypeError, ValueError):
        return ""
    return "" if name == "GUESSED" else name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _folder(path: str) -> ModelFacts:
    config = _json(os.path.join(path, "config.json"))
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    context = _positive_int(config.get("max_position_embeddings") or text.get("max_position_embeddings"))
    template = None
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    else:
        found = _json(os.path.join(path, "tokenizer_config.json")).get("chat_template")
        template = found if isinstance(found, str) else None
    return ModelFacts(str(config.get("model_type", "")), context, template)


def _json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        found = json.load(f)
    return found if isinstance(found, dict) else {}


def _positive_int(value: object) -> int | None:
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return None
    return number if number > 0 else None
