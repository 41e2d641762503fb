"""Decoded JSON that is not valid text.

JSON's ``\\uXXXX`` escapes can spell half of a UTF-16 surrogate pair alone (``"\\ud800"``):
valid JSON, decoded by Python into a str that no UTF-8 encoder, tokenizer or database takes.
The server finds such a string (or object key) anywhere in a request body before it reads a
field, so the answer is a 400 naming where it is rather than an error deep in a tokenizer.
"""

from __future__ import annotations

from typing import Any


def lone_surrogate(value: Any, where: str = "") -> tuple[str, str] | None:
    """The first string (or object key) in a decoded JSON ``value`` that holds a lone
    surrogate, as ``(where it is, what to say)``; None when every string is valid text.
    ``where`` names ``value`` itself ("" for a request body). Walks without recursion (a
    body nested as deep as the JSON decoder allows is fine)."""
    todo: list[tuple[str, Any]] = [(where, value)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, str):
            bad_at = _bad_index(item)
            if bad_at is not None:
                return path or "body", _message(path or "the body", item, bad_at)
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                bad_at = _bad_index(key)
                if bad_at is not None:
                    place = f"a key of {path}" if path else "a key of the body"
                    return path or "body", _message(place, key, bad_at)
                todo.append((f"{path}.{key}" if path else key, child))
        elif isinstance(item, list):
            todo.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None


def _bad_index(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _message(place: str, text: str, at: int) -> str:
    return (f"{place} is not valid text: character {at} is a lone UTF-16 surrogate "
            f"({text[at]!r}); send each surrogate pair whole (or the character itself)")
