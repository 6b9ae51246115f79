"""Keyset (cursor) paging over ``(created_at, id)``, as OpenAI's ``after``/``limit`` lists page.

The cursor is the id of the last object of the previous page; rows are ordered by
``(created_at, id)`` so the order is total and stable while rows are added.
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import Session

from jobs.storable_text import is_possible_id

Row = TypeVar("Row")


class UnknownCursor(LookupError):
    """``after`` names no object of the listed kind."""


def keyset_page(
    session: Session,
    query: Select[Row],
    model: Any,
    *,
    after: str | None,
    limit: int,
    descending: bool = True,
    owner: str | None = None,
) -> tuple[list[Row], bool]:
    """One page of ``query`` (rows of ``model``) after the row with id ``after``.

    ``owner``: the cursor must be a row of that API key (``model.owner_key_id``), as the rows are.

    Returns:
        ``(rows, has_more)``: at most ``limit`` rows, and whether more follow.

    Raises:
        UnknownCursor: ``after`` is not the id of a ``model`` row (of ``owner``).
    """
    created_at, row_id = model.created_at, model.id
    if after is not None:
        cursor = session.get(model, after) if is_possible_id(after) else None
        if cursor is None or (owner is not None and cursor.owner_key_id != owner):
            raise UnknownCursor(f"no object with id {after!r} to page after")
        if descending:
            past = or_(created_at < cursor.created_at, and_(created_at == cursor.created_at, row_id < cursor.id))
        else:
            past = or_(created_at > cursor.created_at, and_(created_at == cursor.created_at, row_id > cursor.id))
        query = query.where(past)
    order = (created_at.desc(), row_id.desc()) if descending else (created_at.asc(), row_id.asc())
    rows = list(session.scalars(query.order_by(*order).limit(limit + 1)))
    return rows[:limit], len(rows) > limit
