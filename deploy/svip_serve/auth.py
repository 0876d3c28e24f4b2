"""API keys: Bearer authentication on every /v1 route. The deployment knows the keys' SHA-256
digests only (from its settings, which Serve shows in its config, so never the keys themselves)
plus the keys in $SVIP_API_KEY (comma-separated, e.g. from a Kubernetes Secret). No key
configured: the API is open.

Each key has an id, which admission counts requests by and logs may show: `name:KEY` (in
$SVIP_API_KEY) or `name:DIGEST` (in the settings) names it; a key without a name is known by the
start of its digest. A key is at least MIN_KEY_CHARS characters: a short one could be guessed, or
found from its unsalted digest."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets

from svip_common.errors import InvalidRequest
from svip_serve.protocol import ApiError

ENV_VAR = "SVIP_API_KEY"
MIN_KEY_CHARS = 32
_NAMED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,62}):(.+)$")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def split_name(entry: str) -> tuple[str | None, str]:
    """`name:secret` -> (name, secret); an entry without a name -> (None, entry)."""
    named = _NAMED.match(entry)
    return (named.group(1), named.group(2)) if named else (None, entry)


def check_key(key: str, where: str = "an API key") -> str:
    """The key itself (a `name:` prefix removed), refused with a clear error when too short."""
    _, secret = split_name(key)
    if len(secret) < MIN_KEY_CHARS:
        raise InvalidRequest(f"{where} is {len(secret)} characters; keys must be at least {MIN_KEY_CHARS} "
                             f"(e.g. `openssl rand -hex 24`)")
    return secret


def named_digest(key: str) -> str:
    """What the settings hold for a key: `name:DIGEST`, or the bare digest."""
    name, secret = split_name(key)
    check_key(secret)
    return f"{name}:{digest(secret)}" if name else digest(secret)


def keys_from_env(environ=os.environ) -> list[str]:
    return [k.strip() for k in environ.get(ENV_VAR, "").split(",") if k.strip()]


class ApiKeys:
    def __init__(self, digests: tuple[str, ...] = (), environ=os.environ):
        entries = {}
        for entry in digests:
            name, hexdigest = split_name(entry)
            entries[hexdigest] = name or f"key-{hexdigest[:12]}"
        for i, key in enumerate(keys_from_env(environ)):
            name, secret = split_name(key)
            check_key(secret, f"key {i + 1} in ${ENV_VAR}")
            entries[digest(secret)] = name or f"key-{digest(secret)[:12]}"
        self._ids = entries  # digest -> id
        self._digests = sorted(entries)

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> str | None:
        """The request's Authorization header against the keys: the key's id (None when the API
        is open); ApiError 401 when it fails."""
        if not self._digests:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("no API key given: send 'Authorization: Bearer <key>'")
        presented = digest(key.strip())
        matches = [hmac.compare_digest(presented, d) for d in self._digests]  # every digest compared
        if not any(matches):
            raise _unauthorized("incorrect API key")
        return self._ids[self._digests[matches.index(True)]]


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type_="invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def sharing_scope(key: str | None, salt: str | None = None) -> str:
    """The KV-sharing scope of a request (svip_common/prompt_sharing.py): its API key's id, or the
    request itself where the API is open (key None: nobody's prompt is known to be its own), narrowed
    by the request's cache_salt; hashed, so the workers never hold a key's name. A request's n
    choices share one scope."""
    owner = f"key:{key}" if key is not None else f"request:{secrets.token_hex(16)}"
    return hashlib.sha256(f"{owner}\0{salt or ''}".encode()).hexdigest()
