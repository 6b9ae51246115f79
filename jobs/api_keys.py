"""API keys: bearer secrets of the HTTP API, stored as SHA-256 hashes (docs/api.md, "API keys").

A key is ``bi-`` + 43 URL-safe characters (32 random bytes, `secrets.token_urlsafe`); only its
SHA-256 (hex) is stored, so the database never holds a usable secret. A fast hash is enough for
random 256-bit secrets (nothing to brute-force, unlike passwords; GitHub and Stripe do the same).

A deployment where no key was ever created is open: every request acts as the one anonymous
owner (``owner = None``), as the zero-setup quick start expects. Once a key exists, every ``/v1``
request needs a live one; revoking every key does not reopen the deployment.

`create_key`, `list_keys`, `revoke_key` serve ``batchinfer keys``; `find_key` and `keys_required`
serve the API's authentication (`api.auth`).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs.errors import NotFound
from jobs.models import API_KEY_ID_PREFIX, ApiKey, new_id
from jobs.status import now_s
from jobs.storable_text import unstorable_reason

KEY_PREFIX = "bi-"
_SHOWN_CHARS = 10


@dataclass(frozen=True, slots=True)
class CreatedKey:
    """A new key's row and its secret (shown once, never stored)."""

    key: ApiKey
    secret: str


def hash_secret(secret: str) -> str:
    """SHA-256 of ``secret`` (UTF-8), 64 hex characters."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def create_key(session: Session, *, name: str = "", now: int | None = None) -> CreatedKey:
    """Insert a new key named ``name`` (flushed, not committed); the secret is returned, only its hash kept.

    Raises:
        ValueError: ``name`` holds a NUL character or a lone surrogate (`jobs.storable_text`).
    """
    reason = unstorable_reason(name)
    if reason is not None:
        raise ValueError(f"the key name {reason}, which the service cannot store")
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(
        id=new_id(API_KEY_ID_PREFIX),
        name=name,
        key_hash=hash_secret(secret),
        key_prefix=secret[:_SHOWN_CHARS],
        created_at=now_s() if now is None else now,
    )
    session.add(key)
    session.flush()
    return CreatedKey(key=key, secret=secret)


def list_keys(session: Session) -> list[ApiKey]:
    """Every key, revoked ones included, oldest first."""
    return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)))


def revoke_key(session: Session, *, key_id: str, now: int | None = None) -> ApiKey:
    """Revoke ``key_id`` (a no-op when already revoked); its objects stay, reachable by no key.

    Raises:
        NotFound: no key has this id.
    """
    key = session.get(ApiKey, key_id)
    if key is None:
        raise NotFound("api key", key_id)
    if key.revoked_at is None:
        key.revoked_at = now_s() if now is None else now
        session.flush()
    return key


def find_key(session: Session, *, secret: str) -> ApiKey | None:
    """The live (not revoked) key whose secret is ``secret``, or None."""
    query = select(ApiKey).where(ApiKey.key_hash == hash_secret(secret), ApiKey.revoked_at.is_(None))
    return session.scalar(query)


def keys_required(session: Session) -> bool:
    """True once any key was ever created (revoked ones count): requests then need a live key."""
    return session.scalar(select(ApiKey.id).limit(1)) is not None
