"""API keys: Bearer authentication on every /v1 route. The deployment knows the keys' SHA-256
digests only (from its settings, which Serve shows in its config, so never the keys themselves)
plus the keys in $SVIP_API_KEY (comma-separated, e.g. from a Kubernetes Secret). No key
configured: the API is open."""

from __future__ import annotations

import hashlib
import hmac
import os

from svip_serve.protocol import ApiError

ENV_VAR = "SVIP_API_KEY"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def keys_from_env(environ=os.environ) -> list[str]:
    return [k.strip() for k in environ.get(ENV_VAR, "").split(",") if k.strip()]


class ApiKeys:
    def __init__(self, digests: tuple[str, ...] = (), environ=os.environ):
        self._digests = sorted(set(digests) | {digest(k) for k in keys_from_env(environ)})

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> None:
        """The request's Authorization header against the keys; ApiError 401 when it fails."""
        if not self._digests:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("no API key given: send 'Authorization: Bearer <key>'")
        presented = digest(key.strip())
        if not any([hmac.compare_digest(presented, d) for d in self._digests]):  # every digest compared
            raise _unauthorized("incorrect API key")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type_="invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})
