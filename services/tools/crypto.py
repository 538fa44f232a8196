"""Encryption of credential secrets at rest (Fernet: AES-128-CBC + HMAC-SHA256).

Secrets are JSON objects (e.g. {"dsn": "postgresql://..."}) encrypted as one Fernet
token; they are decrypted only inside the tools service when an action runs. Masking
rules for display follow the SDK's `auth_data_masked` field: a short readable edge,
stars in the middle, never the whole value.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.common import redaction

if TYPE_CHECKING:
    from cryptography.fernet import Fernet, MultiFernet

# `cryptography` (~7 MiB resident) is imported when the first secret is encrypted or
# decrypted, not at start: an idle service, and every tool call that needs no
# credential, never loads it. The keys are still checked at start (same rule as
# `Fernet(key)`: url-safe base64 of exactly 32 bytes).


class SecretBoxError(Exception):
    """A secret could not be decrypted (wrong key, or tampered ciphertext)."""


#: What an operator is told (in the log, never to a user) when a stored secret cannot be decrypted.
KEY_CHANGED_HINT = (
    "the credential key (LOOPLINE_TOOLS_CREDENTIAL_KEY) was probably changed without keeping the "
    "key "
    "this secret was encrypted with: list the old key(s) after the new one, comma-separated "
    "(NEW,OLD: the first key encrypts, every listed key decrypts), or connect the credential again"
)


class SecretBox:
    """Encrypts and decrypts JSON secrets with one or more Fernet keys.

    Args:
        keys: url-safe base64 Fernet keys; the first encrypts, every one decrypts
            (key rotation). Raises ValueError when a key is malformed or none is given.
    """

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("at least one Fernet key is required")
        self._keys = [k.encode() if isinstance(k, str) else k for k in keys]
        for key in self._keys:
            _check_fernet_key(key)
        self._fernet: MultiFernet | None = None
        self._primary: Fernet | None = None
        self._lock = threading.Lock()

    def _multi(self) -> MultiFernet:
        """The MultiFernet of the keys, built (and `cryptography` imported) on first use."""
        if self._fernet is None:
            with self._lock:  # encrypt/decrypt may run in worker threads
                if self._fernet is None:
                    from cryptography.fernet import Fernet, MultiFernet

                    fernets = [Fernet(k) for k in self._keys]
                    self._primary = fernets[0]
                    self._fernet = MultiFernet(fernets)
        return self._fernet

    def is_current(self, token: str) -> bool:
        """Whether the first key alone decrypts `token` (`Fernet.decrypt` with that key): it is
        already encrypted with the key that encrypts, so `rotate` has nothing to change. False
        for a token only another listed key (or no key) decrypts; never raises."""
        from cryptography.fernet import InvalidToken

        self._multi()
        assert self._primary is not None
        try:
            self._primary.decrypt(token.encode("ascii"))
        except (InvalidToken, ValueError):  # ValueError: text that is not ASCII
            return False
        return True

    def encrypt(self, secret: dict[str, Any]) -> str:
        """The Fernet token (ASCII text) of the JSON object `secret`."""
        return (
            self._multi()
            .encrypt(json.dumps(secret, separators=(",", ":")).encode())
            .decode("ascii")
        )

    def rotate(self, token: str) -> str:
        """`token` encrypted again with the first key (`MultiFernet.rotate`: the same secret and
        timestamp). Raises SecretBoxError when no configured key decrypts it."""
        from cryptography.fernet import InvalidToken

        try:
            return self._multi().rotate(token.encode("ascii")).decode("ascii")
        except (InvalidToken, ValueError) as exc:
            raise SecretBoxError(
                "the credential cannot be decrypted with the configured key"
            ) from exc

    def decrypt(self, token: str) -> dict[str, Any]:
        """The JSON object in `token`. Raises SecretBoxError when it cannot be decrypted."""
        from cryptography.fernet import InvalidToken

        try:
            return json.loads(self._multi().decrypt(token.encode("ascii")))
        except (InvalidToken, ValueError) as exc:
            raise SecretBoxError(
                "the credential cannot be decrypted with the configured key"
            ) from exc


def _check_fernet_key(key: Any) -> None:
    """Raise ValueError unless `key` (bytes) is a Fernet key: url-safe base64 of exactly 32 bytes.

    The same rule as `cryptography.fernet.Fernet.__init__`, checked without importing it.
    """
    try:
        raw = base64.urlsafe_b64decode(key)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise ValueError(
            "the credential key must be a Fernet key (32 url-safe base64 bytes)"
        ) from exc
    if len(raw) != 32:
        raise ValueError("the credential key must be a Fernet key (32 url-safe base64 bytes)")


def mask_value(value: Any) -> str:
    """A masked form of one secret value: "ab****yz" for 12+ characters, else "****"."""
    text = str(value)
    if len(text) >= 12:
        return f"{text[:2]}****{text[-2:]}"
    return "****"


def mask_secret(secret: dict[str, Any]) -> str:
    """A masked form of a whole secret, e.g. "dsn=po****st" (fields sorted, comma-separated)."""
    return ", ".join(f"{key}={mask_value(secret[key])}" for key in sorted(secret))


def redact(text: str, secret: dict[str, Any] | None) -> str:
    """`text` with every secret value (4+ characters) replaced by "***", in every form an error
    or an echo gives it: raw, stripped, backslash- or JSON-escaped, URL-encoded, base64 (as in
    `Basic`), a URL's password (`services.common.redaction`).

    Used on every error message that leaves the service, since driver errors may quote
    a connection string.
    """
    return redaction.redact(text, secret)
