"""Access control: an optional API key, checked for both transports alike.

HTTP clients send `Authorization: Bearer <key>` (what the official openai client sends for its
`api_key`); gRPC clients send the same in the call metadata (`authorization: Bearer <key>`).
The keys come from an environment variable and/or a file (a mounted Kubernetes Secret), named in
the app args (`auth:`, AuthArgs); each source holds one key, or several on separate lines so a
key can be rotated without refusing the clients of the old one. The file is read again when it
changes (a Kubernetes Secret volume is updated in place), so rotating needs no restart. Health
checks stay open.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping

from specserve.protocol import SpecserveError

MISSING_KEY = ("no API key: send it as `Authorization: Bearer <key>` (HTTP header, or gRPC metadata "
               "`authorization`)")
INVALID_KEY = "invalid API key"
RECHECK_S = 10.0  # how often a key file is looked at for changes (a stat, not a read)

logger = logging.getLogger("ray.serve")


class Unauthenticated(Exception):
    """A request without a valid API key (HTTP 401, gRPC UNAUTHENTICATED)."""


def keys_in(text: str) -> list[str]:
    """The keys a source holds: one per non-empty line, surrounding whitespace dropped (a
    Secret file usually ends with a newline)."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def load_api_keys(auth, environ: Mapping[str, str] = os.environ) -> tuple[bytes, ...]:
    """The keys `auth` (AuthArgs) names. A named source that is unset, unreadable or empty is
    refused (SpecserveError): a typo must not silently turn access control off."""
    keys: list[str] = []
    if auth.api_key_env is not None:
        value = environ.get(auth.api_key_env)
        if not value or not keys_in(value):
            raise SpecserveError(f"auth.api_key_env names {auth.api_key_env}, which is unset or empty here: set it "
                                 "where Ray runs (every node), or remove auth to serve without an API key")
        keys += keys_in(value)
    if auth.api_key_file is not None:
        try:
            text = open(auth.api_key_file, encoding="utf-8").read()
        except OSError as exc:
            raise SpecserveError(f"auth.api_key_file {auth.api_key_file} cannot be read ({exc.strerror}): mount it "
                                 "on every node, or remove auth to serve without an API key") from None
        if not keys_in(text):
            raise SpecserveError(f"auth.api_key_file {auth.api_key_file} holds no key")
        keys += keys_in(text)
    return tuple(key.encode() for key in keys)


def bearer_token(authorization: str | None) -> str | None:
    """The credential of an `Authorization: Bearer <token>` value (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def file_version(path: str) -> tuple[int, int, int] | None:
    """What changes when a file is replaced or rewritten (a Secret volume swaps a symlink)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_ino, st.st_size


class ApiKeys:
    """The accepted keys; `check` raises Unauthenticated for a missing or wrong one. Built with
    `from_args`, it reads the key file again when it changes (looked at every `recheck_s`); a
    changed file that holds no key, or cannot be read, keeps the keys it had, with a warning."""

    def __init__(self, keys: Iterable[bytes], *, auth=None, environ: Mapping[str, str] = os.environ,
                 recheck_s: float = RECHECK_S, clock: Callable[[], float] = time.monotonic):
        self.keys = tuple(keys)
        if not self.keys:
            raise ValueError("ApiKeys needs at least one key")
        self.auth, self.environ, self.recheck_s, self.clock = auth, environ, recheck_s, clock
        self.watched = auth.api_key_file if auth is not None else None
        self._version = file_version(self.watched) if self.watched else None
        self._next_look = clock() + recheck_s

    @classmethod
    def from_args(cls, auth, environ: Mapping[str, str] = os.environ, **kwargs) -> ApiKeys:
        return cls(load_api_keys(auth, environ), auth=auth, environ=environ, **kwargs)

    def _reload_if_changed(self) -> None:
        now = self.clock()
        if self.watched is None or now < self._next_look:
            return
        self._next_look = now + self.recheck_s
        version = file_version(self.watched)
        if version == self._version:
            return
        try:
            self.keys = load_api_keys(self.auth, self.environ)
        except SpecserveError as exc:
            logger.warning("API keys not reloaded, the previous ones stay accepted: %s", exc)
            return
        self._version = version
        logger.info("API keys reloaded from %s (%d accepted)", self.watched, len(self.keys))

    def check(self, authorization: str | None) -> None:
        self._reload_if_changed()
        token = bearer_token(authorization)
        if token is None:
            raise Unauthenticated(MISSING_KEY)
        given = token.encode()
        # Constant time, and every key compared, so timing tells nothing about any of them.
        matches = [hmac.compare_digest(given, key) for key in self.keys]
        if not any(matches):
            raise Unauthenticated(INVALID_KEY)


def metadata_value(metadata: Iterable[tuple[str, str | bytes]], name: str) -> str | None:
    """A gRPC metadata entry's value (keys arrive lower-cased)."""
    for key, value in metadata:
        if key.lower() == name:
            return value.decode() if isinstance(value, bytes) else value
    return None
