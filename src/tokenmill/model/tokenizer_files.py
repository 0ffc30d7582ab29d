"""The tokenizer a model's files define: a `tokenizers.Tokenizer` and the special tokens and chat
templates around it, read from a GGUF file's metadata or a Hugging Face folder.

transformers is used only here, at load time, to build exactly the tokenizer it would build itself
(so our ids match Hugging Face's). The frontend wraps this in its Tokenizer (encode, decode, chat
templates); the engine hands the same `tokenizers` object to the grammar backend, so structured
output masks the ids the frontend encodes with, from one load.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import tokenizers

from tokenmill.errors import ModelLoadError

logger = logging.getLogger(__name__)

# llama.cpp ends generation on any of these ("end of generation" tokens), not only on EOS.
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


@dataclass(frozen=True, eq=False)
class TokenizerFiles:
    backend: tokenizers.Tokenizer
    bos_token_id: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    eos_token: str | None = None  # the model's main EOS, as templates see it
    chat_template: str | None = None
    named_chat_templates: Mapping[str, str] = field(default_factory=dict)


# Tokenizers this process got without building them (tokenizer_export.load: read from the export
# child's file), so that a later load_tokenizer_files of the same path - the grammar backend's - is
# that very object, not a second build through transformers.
_handed_over: dict[str, TokenizerFiles] = {}


def remember(path: str, files: TokenizerFiles) -> None:
    """`files` is the tokenizer of `path` (absolute) in this process from now on."""
    _handed_over[path] = files


def load_tokenizer_files(path: str) -> TokenizerFiles:
    """What the .gguf file or Hugging Face folder at `path` (absolute) defines; cached per path. Built
    here, through transformers, unless this process was handed it (remember())."""
    return _handed_over.get(path) or _build(path)


@functools.lru_cache(maxsize=8)
def _build(path: str) -> TokenizerFiles:
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _load_gguf(path)
    if os.path.isdir(path):
        return _load_hf_folder(path)
    raise ModelLoadError(path, "expected a .gguf file or a Hugging Face model folder")


def sentencepiece_files(path: str) -> TokenizerFiles | None:
    """What the file at `path` (absolute) defines if it is a SentencePiece GGUF, whose build needs no
    transformers (spm_vocab.py); None for any other model."""
    if not (os.path.isfile(path) and path.endswith(".gguf")):
        return None
    meta = _gguf_metadata(path)
    return _load_gguf(path, meta) if meta.get("tokenizer.ggml.model") == "llama" else None


def _gguf_metadata(path: str) -> dict[str, Any]:
    # Load time only: the GGUF reader needs numpy, which the server's text processes (they import
    # this module for the tokenizer's files) never load.
    from tokenmill.model.gguf_metadata import read_gguf_metadata

    try:
        return read_gguf_metadata(path)
    except Exception as exc:  # a truncated or foreign file: name it
        raise ModelLoadError(path, f"cannot read the GGUF metadata: {exc}") from exc


def _load_gguf(path: str, meta: dict[str, Any] | None = None) -> TokenizerFiles:
    meta = _gguf_metadata(path) if meta is None else meta
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):  # what every vocabulary needs
        if key not in meta:
            raise ModelLoadError(path, f"cannot build the tokenizer: the GGUF metadata has no {key!r}")
    try:
        if meta.get("tokenizer.ggml.model") == "llama":
            # SentencePiece: built as llama.cpp tokenizes (spm_vocab.py), not by transformers'
            # converter, whose Gemma tokenizer gives other ids; nor is transformers imported for it.
            backend = _spm_backend(path, meta)
        else:
            backend = _backend_of(_transformers_gguf_tokenizer(path), path)
    except ModelLoadError:
        raise
    except KeyError as exc:  # transformers reads the tokenizer's keys without their prefix: name the real one
        raise ModelLoadError(path, f"cannot build the tokenizer: the GGUF metadata has no "
                                   f"'tokenizer.ggml.{exc.args[0] if exc.args else ''}'") from exc
    except Exception as exc:  # transformers raises many kinds; the user needs the file and the cause
        raise ModelLoadError(path, f"cannot build the tokenizer from GGUF metadata: {exc}") from exc
    eos = {int(meta[k]) for k in _GGUF_EOS_KEYS if meta.get(k) is not None}
    main_eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    prefix = "tokenizer.chat_template."
    named = {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix) and isinstance(v, str)}
    return TokenizerFiles(
        backend,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=frozenset(eos),
        eos_token=None if main_eos is None else backend.id_to_token(int(main_eos)),
        chat_template=meta.get("tokenizer.chat_template"),
        named_chat_templates=named,
    )


def _transformers_gguf_tokenizer(path: str) -> Any:
    """transformers' tokenizer of a GGUF, built from a copy of its metadata alone: its reader would
    also parse the tensor table, and refuse tensor types gguf-py does not know yet (model/gguf_metadata.py)."""
    import tempfile

    from transformers import AutoTokenizer  # load time only: it is slow to import

    from tokenmill.model.gguf_metadata import write_metadata_only

    with tempfile.TemporaryDirectory(prefix="tokenmill-gguf-meta-") as tmp:
        copy = os.path.join(tmp, os.path.basename(path))
        write_metadata_only(path, copy)
        return AutoTokenizer.from_pretrained(tmp, gguf_file=os.path.basename(copy), local_files_only=True)


def _spm_backend(path: str, meta: dict[str, Any]) -> tokenizers.Tokenizer:
    from tokenmill.model.spm_vocab import build_spm_tokenizer

    tokens = meta.get("tokenizer.ggml.tokens")
    scores, types = meta.get("tokenizer.ggml.scores"), meta.get("tokenizer.ggml.token_type")
    if not tokens or scores is None or types is None or not len(tokens) == len(scores) == len(types):
        raise ModelLoadError(path, "a SentencePiece vocabulary needs tokenizer.ggml.tokens, scores and "
                                   "token_type of one length")
    return build_spm_tokenizer(meta, tokens, scores.tolist(), types.tolist())


def _load_hf_folder(folder: str) -> TokenizerFiles:
    config = _read_json(folder, "tokenizer_config.json")
    try:
        from transformers import AutoTokenizer  # load time only

        backend = _backend_of(AutoTokenizer.from_pretrained(folder, local_files_only=True), folder)
    except Exception as exc:
        # A custom tokenizer class transformers cannot build still leaves a usable tokenizer.json.
        tokenizer_json = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(tokenizer_json):
            raise ModelLoadError(folder, f"no tokenizer.json and transformers failed: {exc}") from exc
        logger.warning(
            "transformers could not load the tokenizer of %s (%s); using tokenizer.json", folder, exc
        )
        backend = tokenizers.Tokenizer.from_file(tokenizer_json)

    def token_id(value: Any) -> int | None:
        content = value.get("content") if isinstance(value, dict) else value
        return backend.token_to_id(content) if isinstance(content, str) else None

    model_config = _read_json(folder, "config.json")
    eos: set[int] = set()
    main_eos = token_id(config.get("eos_token"))
    if main_eos is not None:
        eos.add(main_eos)
    # generation_config lists every token that ends a turn (Llama 3: <|eot_id|> and <|end_of_text|>).
    for source in (_read_json(folder, "generation_config.json"), model_config):
        eos.update(_as_ids(source.get("eos_token_id")))
    bos = token_id(config.get("bos_token"))
    if bos is None and isinstance(model_config.get("bos_token_id"), int):
        bos = model_config["bos_token_id"]
    default, named = _hf_chat_templates(folder, config)
    return TokenizerFiles(
        backend,
        bos_token_id=bos,
        eos_token_ids=frozenset(eos),
        eos_token=None if main_eos is None else backend.id_to_token(main_eos),
        chat_template=default,
        named_chat_templates=named,
    )


def _hf_chat_templates(folder: str, config: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):  # newer exports keep the template in its own file; it wins
        with open(jinja_path, encoding="utf-8") as f:
            return f.read(), {}
    template = config.get("chat_template") or _read_json(folder, "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
        return named.get("default"), named
    return (template if isinstance(template, str) else None), {}


def _backend_of(hf: Any, path: str) -> tokenizers.Tokenizer:
    backend = getattr(hf, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        raise ModelLoadError(path, f"transformers built a {type(hf).__name__}, which has no fast tokenizer")
    # Requests are tokenized one by one; padding or truncation set by a config would corrupt prompts.
    backend.no_padding()
    backend.no_truncation()
    return backend


def _read_json(folder: str, name: str) -> dict[str, Any]:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(path, f"unreadable JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
