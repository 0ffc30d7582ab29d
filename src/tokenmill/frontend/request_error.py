"""The error a request ends with when it cannot be served: its own module so that the tokenizer manager
and the helpers it uses (the live bound, the tokenizer pool) can all raise it without importing each other."""

from __future__ import annotations


class RequestError(Exception):
    """A request that cannot be served or was ended outside the normal stream; `status` is HTTP's."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = headers  # e.g. Retry-After on an overload 503
