"""What a failed outbound call is called in a tool's error: a closed set of kinds.

An exception's own text never reaches a tool result (the model, the stream, the stored chat):
a driver's or HTTP library's message may quote a header value (a token), a connection string,
an internal host name, an address or a file path. These functions name the failure from the
exception's type (and its causes) only; docs/security.md, "Client-visible text", lists them.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl
import sys
from collections.abc import Iterator

#: Why the outbound policy refused a destination (netpolicy.classify's kinds), as a tool error names
#: it.
POLICY_KINDS = ("unspecified", "loopback", "link-local", "multicast", "private", "reserved")

# The kinds of a failed HTTP request (`http_failure`), most specific first.
TIMED_OUT_CONNECTING = "the connection timed out"
NO_ANSWER = "the server did not answer in time"
SEND_TIMED_OUT = "sending the request timed out"
REFUSED = "the connection was refused"
UNRESOLVED = "the host name does not resolve"
TLS_FAILED = "the TLS handshake failed (certificate or protocol)"
NOT_CONNECTED = "could not connect to the server"
BROKE_READING = "the connection broke while reading the response"
BROKE_SENDING = "the connection broke while sending the request"
BAD_ANSWER = "the server's answer is not valid HTTP, or it closed the connection"
BAD_HEADER = (
    "a header name or value is not valid HTTP (a line break or a character that is not ASCII)"
)
UNDECODABLE = "the response body could not be decoded"
INVALID_URL = "invalid URL: check its host, port and characters"
UNSUPPORTED_SCHEME = "the URL's scheme is not supported (use http or https)"
FAILED = "the request failed"


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions behind it (`__cause__`, else `__context__`), at most 20."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 20:
        yield current
        seen += 1
        current = current.__cause__ or current.__context__


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def network_failure(exc: BaseException) -> str | None:
    """The kind of a failed connection among `exc` and its causes (timeout, refused, unresolved,
    TLS, another socket error by its errno name), or None when none of them is one."""
    for cause in causes(exc):
        if isinstance(cause, ssl.SSLError) or "SSLError" in _names(cause):
            return TLS_FAILED
        if isinstance(cause, socket.gaierror):
            return UNRESOLVED
        if isinstance(cause, ConnectionRefusedError):
            return REFUSED
        if isinstance(cause, (TimeoutError, asyncio.TimeoutError)):
            return TIMED_OUT_CONNECTING
    for cause in causes(exc):
        if (
            isinstance(cause, OSError)
            and isinstance(cause.errno, int)
            and cause.errno in errno.errorcode
        ):
            return f"a network error ({errno.errorcode[cause.errno]})"
    return None


# httpx's exception classes by name, most specific first, with the kind each means
_HTTPX_KINDS = (
    ("ConnectTimeout", TIMED_OUT_CONNECTING),
    ("ReadTimeout", NO_ANSWER),
    ("WriteTimeout", SEND_TIMED_OUT),
    ("TimeoutException", NO_ANSWER),
    ("ConnectError", NOT_CONNECTED),
    ("ReadError", BROKE_READING),
    ("WriteError", BROKE_SENDING),
    ("LocalProtocolError", BAD_HEADER),
    ("RemoteProtocolError", BAD_ANSWER),
    ("DecodingError", UNDECODABLE),
    ("UnsupportedProtocol", UNSUPPORTED_SCHEME),
    ("TooManyRedirects", "too many redirects"),
)


def http_failure(exc: BaseException) -> str:
    """The kind of a failed httpx request (`exc` an httpx.HTTPError, or an error behind one)."""
    httpx = sys.modules.get("httpx")
    if httpx is None or not isinstance(exc, httpx.HTTPError):
        return network_failure(exc) or FAILED
    for name, kind in _HTTPX_KINDS:
        if isinstance(exc, getattr(httpx, name)):
            return (network_failure(exc) or kind) if name == "ConnectError" else kind
    return network_failure(exc) or FAILED


def policy_refusal(exc: BaseException, what: str) -> str:
    """Why the outbound policy refused `what` (e.g. "the database host in the credential"),
    without naming the host or its addresses: it does not resolve, or it resolves to an address
    of one of POLICY_KINDS. Read from the exception's type, its cause, and which of those
    words netpolicy's message holds."""
    if any(isinstance(cause, socket.gaierror) for cause in causes(exc)) or "cannot resolve" in str(
        exc
    ):
        return f"{what} does not resolve"
    text = str(exc)
    for kind in POLICY_KINDS:
        if f" {kind} address" in text:
            article = "an" if kind[0] in "aeiou" else "a"
            return (
                f"{what} is not allowed: it resolves to {article} {kind} address, "
                "which the outbound policy of this deployment does not allow"
            )
    if "unix socket" in text:
        return f"{what} is not allowed: unix sockets are not an allowed destination"
    return f"{what} is not allowed by the outbound policy of this deployment"


def unexpected(exc: BaseException) -> str:
    """The kind of an exception no integration expected: a network failure or an httpx error by
    its kind, else "an internal error" (the type and where it was raised go to the log only)."""
    httpx = sys.modules.get("httpx")
    if httpx is not None and isinstance(exc, httpx.HTTPError):
        return f"the HTTP request failed: {http_failure(exc)}"
    kind = network_failure(exc) if isinstance(exc, (OSError, TimeoutError)) else None
    if kind is not None:
        return kind
    return "an internal error in the integration (logged)"
