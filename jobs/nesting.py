"""A cap on how deeply user JSON nests, checked without recursion.

Python's ``json`` parser and encoder, ``repr`` and the database drivers recurse once per level of
nesting, and share the interpreter's recursion limit (1,000 frames) with whatever called them: a line
nested 990 levels deep parses in the API but raises ``RecursionError`` deeper in the worker's stack.
So user JSON (batch lines and their bodies) is held to `MAX_JSON_DEPTH` levels, checked by
`too_deep` with an explicit stack, far below that limit and far above any real request (a chat line
is 5 levels deep: line, body, messages, message, content parts).
"""

from __future__ import annotations

from typing import Any

MAX_JSON_DEPTH = 64
"""Most levels of arrays and objects in one batch line (the line object itself is level 1)."""


def too_deep(value: Any, *, text: str | None = None, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` (parsed JSON: dicts, lists, scalars) nests more than ``max_depth`` levels.

    ``text``, the JSON ``value`` was parsed from, lets a line with at most ``max_depth`` brackets skip
    the walk (it cannot nest deeper than it has brackets).
    """
    if text is not None and text.count("[") + text.count("{") <= max_depth:
        return False
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth + 1 > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
