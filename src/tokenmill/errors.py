"""Errors a user can read: each names the thing that is wrong."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class of every error tokenmill raises on purpose."""


class InvalidRequest(TokenmillError, ValueError):
    """A request or parameter the engine will not run; `param` names the culprit.

    The HTTP layer maps it to a 400 in the OpenAI error format.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self):  # across processes (data-parallel replicas) with its param
        return type(self), (self.message, self.param)


class ModelLoadError(TokenmillError):
    """A model that cannot be loaded: names the file and the problem."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"cannot load model from {path}: {problem}")
        self.path = path
        self.problem = problem

    def __reduce__(self):
        return type(self), (self.path, self.problem)


def is_int(value: object) -> bool:
    """An integer parameter's check: True is an int to Python, not to a request (JSON's true is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)
