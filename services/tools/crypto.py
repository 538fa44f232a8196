"""Encryption of credential secrets at rest (Fernet: AES-128-CBC + HMAC-SHA256).

Secrets are JSON objects (e.g. {"dsn": "postgresql://..."}) encrypted as one Fernet
token; they are decrypted only inside the tools service when an action runs. Masking
rules for display follow the SDK's `auth_data_masked` field: a short readable edge,
stars in the middle, never the whole value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet


class SecretBoxError(Exception):
    """A secret could not be decrypted (wrong key, or tampered ciphertext)."""


class SecretBox:
    """Encrypts and decrypts JSON secrets with one or more Fernet keys.

    Args:
        keys: url-safe base64 Fernet keys; the first encrypts, every one decrypts
            (key rotation). Raises ValueError when a key is malformed or none is given.
    """

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("at least one Fernet key is required")
        try:
            self._fernet = MultiFernet([Fernet(k.encode() if isinstance(k, str) else k) for k in keys])
        except (ValueError, TypeError) as exc:
            raise ValueError("the credential key must be a Fernet key (32 url-safe base64 bytes)") from exc

    def encrypt(self, secret: dict[str, Any]) -> str:
        """The Fernet token (ASCII text) of the JSON object `secret`."""
        return self._fernet.encrypt(json.dumps(secret, separators=(",", ":")).encode()).decode("ascii")

    def decrypt(self, token: str) -> dict[str, Any]:
        """The JSON object in `token`. Raises SecretBoxError when it cannot be decrypted."""
        try:
            return json.loads(self._fernet.decrypt(token.encode("ascii")))
        except (InvalidToken, ValueError) as exc:
            raise SecretBoxError("the credential cannot be decrypted with the configured key") from exc


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
    """`text` with every secret value (4+ characters) and URL password in it replaced by "***".

    Used on every error message that leaves the service, since driver errors may quote
    a connection string.
    """
    if not secret:
        return text
    values: list[str] = []
    for value in secret.values():
        if isinstance(value, str) and len(value) >= 4:
            values.append(value)
            # A password inside a URL ("scheme://user:password@host") on its own.
            if "://" in value and "@" in value:
                userinfo = value.split("://", 1)[1].split("@", 1)[0]
                if ":" in userinfo:
                    password = userinfo.split(":", 1)[1]
                    if len(password) >= 3:
                        values.append(password)
    for value in sorted(values, key=len, reverse=True):
        text = text.replace(value, "***")
    return text
