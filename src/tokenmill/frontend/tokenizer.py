"""The model's tokenizer: a `tokenizers.Tokenizer` plus the special tokens and chat template around it.

transformers is used only at load time, to build exactly the tokenizer it would build itself (from a
GGUF file's metadata, or from a Hugging Face folder with its add_bos/add_eos rules), so our ids match
Hugging Face's. Everything per request (encode, decode, streaming) goes straight to `tokenizers`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers

from tokenmill.errors import ModelLoadError
from tokenmill.frontend.chat_template import render_chat_template

logger = logging.getLogger(__name__)

# llama.cpp ends generation on any of these ("end of generation" tokens), not only on EOS.
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


class Tokenizer:
    """Shared by all requests of a model; stateless after construction, so safe across threads."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        eos_token: str | None = None,
        chat_template: str | None = None,
        named_chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = frozenset(eos_token_ids)
        self._chat_template = chat_template
        self._named_templates = dict(named_chat_templates or {})
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        if eos_token is None and self._eos_token_ids:
            eos_token = backend.id_to_token(min(self._eos_token_ids))
        self._eos_token = eos_token  # what templates see as eos_token: the model's main one

    @classmethod
    def from_model_path(cls, path: str) -> Tokenizer:
        """Load from a .gguf file or a Hugging Face model folder; cached per path (loading takes seconds)."""
        return _load(os.path.abspath(os.path.expanduser(path)))

    # --- hot path -------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for `text`. add_special_tokens applies the model's own rule (e.g. prepend BOS or not)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --- model facts ----------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be padded larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def bos_token(self) -> str | None:
        return None if self._bos_token_id is None else self._backend.id_to_token(self._bos_token_id)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Every id that decode(..., skip_special_tokens=True) drops (added tokens marked special)."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    # --- chat -----------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        template = self._chat_template
        if tools and "tool_use" in self._named_templates:
            # Like transformers: models that ship a separate tool-use template want it when tools are given.
            template = self._named_templates["tool_use"]
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            chat_template_kwargs=chat_template_kwargs,
        )

    def apply_chat_template(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        # The template writes any BOS itself; transformers also tokenizes without special tokens here.
        return self.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=8)
def _load(path: str) -> Tokenizer:
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _load_gguf(path)
    if os.path.isdir(path):
        return _load_hf_folder(path)
    raise ModelLoadError(path, "expected a .gguf file or a Hugging Face model folder")


def _load_gguf(path: str) -> Tokenizer:
    from transformers import AutoTokenizer  # load time only: it is slow to import

    try:
        meta = _gguf_metadata(path)
        hf = AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
        )
    except Exception as exc:  # transformers raises many kinds; the user needs the file and the cause
        raise ModelLoadError(path, f"cannot build the tokenizer from GGUF metadata: {exc}") from exc
    eos = {int(meta[k]) for k in _GGUF_EOS_KEYS if meta.get(k) is not None}
    main_eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    prefix = "tokenizer.chat_template."
    named = {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix) and isinstance(v, str)}
    backend = _backend_of(hf, path)
    return Tokenizer(
        backend,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos,
        eos_token=None if main_eos is None else backend.id_to_token(int(main_eos)),
        chat_template=meta.get("tokenizer.chat_template"),
        named_chat_templates=named,
    )


def _gguf_metadata(path: str) -> dict[str, Any]:
    try:
        # transformers' reader skips the big arrays (vocabulary, merges): much faster than gguf's.
        from transformers.integrations.gguf.reader import read_gguf_metadata
    except ImportError:
        import gguf

        reader = gguf.GGUFReader(path)
        big = (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.scores",
        )
        return {
            k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.") and k not in big
        }
    metadata, _ = read_gguf_metadata(path, ())
    return metadata


def _load_hf_folder(folder: str) -> Tokenizer:
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
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=eos,
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
