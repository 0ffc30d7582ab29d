"""The model's tokenizer: a `tokenizers.Tokenizer` plus the special tokens and chat template around it.

Loading (model/tokenizer_files.py) builds exactly the tokenizer transformers would build (from a
GGUF file's metadata, or from a Hugging Face folder with its add_bos/add_eos rules), so our ids match
Hugging Face's; `from_model_path` has it built in the export child (model/tokenizer_export.py) or
taken from the cache, so transformers stays out of this process. Everything per request (encode,
decode, streaming) goes straight to `tokenizers`.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers

from tokenmill.errors import InvalidRequest
from tokenmill.frontend.chat_template import render_chat_template
from tokenmill.frontend.length_bound import max_chars_per_token, min_token_count
from tokenmill.model.tokenizer_export import load as load_tokenizer
from tokenmill.model.tokenizer_files import TokenizerFiles

logger = logging.getLogger(__name__)

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
        # The most characters one token covers (length_bound.py): a length check without tokenizing.
        self._max_chars_per_token = max_chars_per_token(backend)

    @classmethod
    def from_model_path(cls, path: str) -> Tokenizer:
        """Load from a .gguf file or a Hugging Face model folder; cached per path (loading takes seconds)."""
        return _load(os.path.abspath(os.path.expanduser(path)))

    @classmethod
    def from_files(cls, files: TokenizerFiles) -> Tokenizer:
        return cls(files.backend, bos_token_id=files.bos_token_id, eos_token_ids=files.eos_token_ids,
                   eos_token=files.eos_token, chat_template=files.chat_template,
                   named_chat_templates=files.named_chat_templates)

    # --- hot path -------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for `text`. add_special_tokens applies the model's own rule (e.g. prepend BOS or not)."""
        try:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the library's "TextInputSequence must be str": say what is wrong instead
            if not isinstance(text, str):
                raise InvalidRequest(f"a prompt must be text, got {type(text).__name__}", param="prompt") from None
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # lone surrogates: bytes that were not UTF-8, escaped by Python
                raise InvalidRequest(f"the text is not valid Unicode: it holds {text[exc.start]!r} (bytes that are "
                                     "not UTF-8?)", param="prompt") from None
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def min_token_count(self, text: str) -> int:
        """At most len(encode(text)), in O(1): 0 for a tokenizer without a provable bound."""
        return min_token_count(text, self._max_chars_per_token)

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

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer with `template` in place of the model's templates (`--chat-template`)."""
        other = copy.copy(self)
        other._chat_template, other._named_templates = template, {}
        return other

    # --- chat -----------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
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
            continue_final_message=continue_final_message,
        )

    def apply_chat_template(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            continue_final_message=continue_final_message,
        )
        # The template writes any BOS itself; transformers also tokenizes without special tokens here.
        return self.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=8)
def _load(path: str) -> Tokenizer:
    return Tokenizer.from_files(load_tokenizer(path))
