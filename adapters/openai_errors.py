"""The server's answers other than 200, in OpenAI's error shape, and what each exception a
Speculator raises for a request means to its client.

:class:`ApiError` is every refusal the server writes (its HTTP status and OpenAI's error
object). :data:`REFUSALS` maps a Speculator's refusal of a request, by the exception's type,
to the 400 the client gets; both endpoints answer through :func:`refused`, so a request too
long for the model's context is ``context_length_exceeded`` on chat and completions alike,
whatever its message says.
"""

from __future__ import annotations

from typing import Any

from agentspec.errors import ContextLengthError
from agentspec.grammar.spec import GrammarError


class ApiError(Exception):
    """An answer other than 200: its HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 about ``param``."""
    return ApiError(400, message, param=param, code=code)


def _template_errors() -> tuple[type[Exception], ...]:
    """jinja2's base error (a chat template that refuses its messages raises one), when
    jinja2 is installed: without it no template is rendered."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers brings jinja2
        return ()
    return (TemplateError,)


# A Speculator's refusal of a request, by the exception's type (the first that matches):
# (type, the error's code, what its message starts with). Anything else is not the request's
# fault: it is raised on, and the server answers 500.
REFUSALS: tuple[tuple[type[Exception], str, str], ...] = (
    (ContextLengthError, "context_length_exceeded", ""),
    (GrammarError, "invalid_schema", ""),
    *((kind, "invalid_messages", "the chat template cannot render these messages: ")
      for kind in _template_errors()),
    (ValueError, "invalid_request", ""),
)


def refused(exc: BaseException, param: str, where: str = "") -> ApiError | None:
    """The 400 a request gets when opening its stream raised ``exc`` (:data:`REFUSALS`),
    naming ``param`` (``where``: what the message starts with, the prompt it is about); None
    when ``exc`` is not a refusal of the request."""
    for kind, code, said in REFUSALS:
        if isinstance(exc, kind):
            return ApiError(400, f"{where}{said}{exc}"[:500], param=param, code=code)
    return None
