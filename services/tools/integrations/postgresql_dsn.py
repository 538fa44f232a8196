"""The `postgresql` integration's reading of a credential's `dsn` (a `postgresql://` URL).

One reading serves both the outbound policy and the connection (`parse_dsn`), and TLS is
required unless the DSN asks otherwise (DEFAULT_SSLMODE).
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

from services.tools.catalogue import ActionError

SSL_MODES = (
    "disable",
    "allow",
    "prefer",
    "require",
    "verify-ca",
    "verify-full",
)  # libpq's sslmode values
# The sslmode of a DSN that names none: TLS is required. libpq's and the driver's own
# default, `prefer`, falls back to a plain connection when the server refuses TLS, and then sends
# the password in clear to whoever answered. `sslmode=disable` (or `prefer`, `allow`) in the DSN
# asks for a plain connection explicitly; `verify-ca` / `verify-full` also check the certificate.
DEFAULT_SSLMODE = "require"
_IGNORED_PARAMS = frozenset({"application_name", "connect_timeout"})  # the action sets its own
_HOST_PORT = re.compile(
    r"(?:\[[0-9A-Fa-f:.]+\]|[^\[\]@:/,%]+)(?::[0-9]+)?"
)  # one host (an IPv6 address in brackets), a port


class DsnError(ActionError):
    """The credential's `dsn` is not one this integration connects to; the message never quotes it
    (a secret)."""


@dataclass(frozen=True)
class Dsn:
    """The parts of a `postgresql://` URL the driver is given, one by one (`parse_dsn`)."""

    host: str
    port: int
    user: str
    password: str
    database: str
    sslmode: str | None


def parse_dsn(dsn: str) -> Dsn:
    """The one reading of `dsn` that both the outbound policy and the connection use.

    `postgresql://[user[:password]@]host[:port][/database][?sslmode=...]` (RFC 3986 with
    libpq's names; `postgres://` too): one host name or address (an IPv6 address in
    brackets), at most one `@` (percent-encode one in a user name or password: `%40`), and
    of the query parameters only `sslmode` (`application_name` and `connect_timeout` are
    accepted and ignored: the action sets its own). Defaults: port 5432, user `postgres`,
    database the user's name, no password, sslmode None (the connection then requires TLS:
    DEFAULT_SSLMODE). Raises DsnError
    for anything else: host lists and `host=`/`hostaddr=` (sockets), other parameters (some
    name files on the tools host), a second `@`.

    Why so strict: urllib reads the host after the last `@` while asyncpg reads it after the
    first and ignores text after a bracketed host, so `postgres@[::ffff:127.0.0.1]:5432@8.8.8.8`
    would pass the policy as 8.8.8.8 and connect to loopback.
    """
    invalid = "the credential's `dsn` is not a valid postgresql:// URL"
    try:
        parsed = urllib.parse.urlsplit(dsn)
        port = parsed.port or 5432
    except ValueError:
        raise DsnError(invalid) from None
    if parsed.scheme not in ("postgresql", "postgres"):
        raise DsnError("the credential's `dsn` must start with postgresql://")
    if parsed.netloc.count("@") > 1:
        raise DsnError(
            "the credential's `dsn` has more than one '@' before its host; write an '@' in the "
            "user name or password as %40"
        )
    host_port = parsed.netloc.rpartition("@")[2]
    if not parsed.hostname or not _HOST_PORT.fullmatch(host_port):
        raise DsnError(
            "the credential's `dsn` must name one database host (host lists and sockets are not "
            "allowed here)"
        )
    try:
        params = urllib.parse.parse_qs(
            parsed.query, keep_blank_values=True, strict_parsing=bool(parsed.query)
        )
    except ValueError:
        raise DsnError(invalid) from None
    unknown = sorted(set(params) - _IGNORED_PARAMS - {"sslmode"})
    if unknown:
        raise DsnError(
            "the credential's `dsn` has parameters this integration does not take: "
            f"{', '.join(unknown)} (it takes sslmode)"
        )
    modes = params.get("sslmode", [])
    if len(modes) > 1 or (modes and modes[0] not in SSL_MODES):
        raise DsnError(
            f"the credential's `dsn` has an sslmode that is not one of {', '.join(SSL_MODES)}"
        )
    user = urllib.parse.unquote(parsed.username) if parsed.username else "postgres"
    database = urllib.parse.unquote(parsed.path[1:]) if len(parsed.path) > 1 else user
    return Dsn(
        host=parsed.hostname,
        port=port,
        user=user,
        password=urllib.parse.unquote(parsed.password or ""),
        database=database,
        sslmode=modes[0] if modes else None,
    )


def dsn_sslmode(dsn: str) -> str | None:
    """The `sslmode` a DSN names in its query (the last one, as the driver reads it), or None."""
    try:
        modes = urllib.parse.parse_qs(urllib.parse.urlsplit(dsn).query, keep_blank_values=True).get(
            "sslmode"
        )
    except ValueError:
        return None
    return modes[-1] if modes else None
