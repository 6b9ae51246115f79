"""Text the service can store: no NUL character and no lone surrogate.

PostgreSQL ``text`` and ``varchar`` cannot hold the NUL character (U+0000): psycopg refuses to send
one. A lone surrogate (U+D800..U+DFFF, which JSON's ``"\\ud800"`` escape gives) is not Unicode text at
all: it cannot be encoded as UTF-8, so neither PostgreSQL, SQLite, the tokenizer nor an output file can
take it. Both arrive easily in JSON (``"\\u0000"``), so every user text the service keeps or runs is
checked here first (docs/api.md, "Text the service stores"):

- an id or a cursor (`is_possible_id`) that cannot be stored names no object: a 404 or a 400, never a
  database error;
- a line's body (`first_unstorable`) with such a character anywhere, in a value or in a key, is that
  line's 400 naming the field (`jobs.line_body.parse_body`); a ``custom_id`` is kept JSON-escaped
  (`jobs.validation`);
- metadata, file names and API key names are refused with a 400 (`unstorable_reason`).

JSON columns are safe as they are: SQLAlchemy writes them with ``ensure_ascii`` escapes.
"""

from __future__ import annotations

import re
from typing import Any

MAX_ID_CHARS = 64
"""Longest id of a stored object (the ``String(64)`` id columns of `jobs.models`)."""

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def unstorable_reason(text: str) -> str | None:
    """Why ``text`` cannot be stored (``"contains a NUL character (\\u0000)"``), or None when it can."""
    match = _UNSTORABLE.search(text)
    if match is None:
        return None
    char = match.group()
    what = "a NUL character" if char == "\x00" else "a lone surrogate (not Unicode text)"
    return f"contains {what} ({_escape_char(char)}) at character {match.start()}"


def is_storable(text: str) -> bool:
    """Whether ``text`` has no NUL character and no lone surrogate."""
    return _UNSTORABLE.search(text) is None


def escaped(text: str) -> str:
    """``text`` with each NUL and lone surrogate written as its JSON escape (``\\u0000``), for messages."""
    return _UNSTORABLE.sub(lambda match: _escape_char(match.group()), text)


def is_possible_id(value: str, *, max_chars: int = MAX_ID_CHARS) -> bool:
    """Whether ``value`` could be the id of a stored object: storable and at most ``max_chars`` characters.

    A lookup by any other value finds nothing; callers answer it as "not found" without asking the
    database, which would refuse a NUL.
    """
    return len(value) <= max_chars and is_storable(value)


def first_unstorable(value: Any) -> tuple[str | None, str] | None:
    """The first string in parsed JSON ``value`` (dicts, lists, scalars) that cannot be stored.

    Keys are checked as well as values (an object's keys before what they hold), without recursion.

    Returns:
        ``(param, reason)``: OpenAI's ``param`` for the place (``messages[0].content``; for a bad key,
        the path to that key, escaped; None for ``value`` itself) and `unstorable_reason`'s words;
        or None when every string is storable.
    """
    stack: list[tuple[Any, str | None]] = [(value, None)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            reason = unstorable_reason(item)
            if reason is not None:
                return path, reason
        elif isinstance(item, dict):
            children: list[tuple[Any, str | None]] = []
            for key, child in item.items():
                child_path = escaped(key) if path is None else f"{path}.{escaped(key)}"
                reason = unstorable_reason(key)
                if reason is not None:
                    return child_path, f"the key {reason}"
                children.append((child, child_path))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend(reversed([(child, f"{path or ''}[{index}]") for index, child in enumerate(item)]))
    return None


def _escape_char(char: str) -> str:
    return f"\\u{ord(char):04x}"
