"""An integration worker: runs third-party integration actions, one at a time, outside the tools
service, with the outbound policy enforced at the socket.

Started by pool.py as `python -I worker_main.py` under the integrations interpreter: standard
library only, Python 3.11 and 3.12, no `services.*` import (the pool imports it too, without side
effect). What it does, in order (`main`):
1. keeps private copies of stdin and stdout for the protocol, fd 0 on /dev/null and fd 1 on fd 2,
   so integration code that prints or reads cannot corrupt it;
2. limits its address space (RLIMIT_AS, `LOOPLINE_WORKER_MEMORY_MB`; 0 = no limit);
3. installs the outbound policy as an audit hook: `socket.connect`, `sendto` and `sendmsg` to an
   address that is not public (`classify`, a copy of services/tools/netpolicy.py's) raise
   `RefusedByPolicy` (a ConnectionRefusedError) unless `LOOPLINE_WORKER_ALLOW_PRIVATE` is true;
   AF_UNIX, other non-IP families and an unresolved host name are always refused, and so is
   process creation (`ProcessRefused`), so no child escapes the hook. A request's `named` hosts
   (the model's) are refused unless they are among its `own` (the integration's): `judge_name`;
4. wraps `socket.getaddrinfo` so the hosts of `LOOPLINE_WORKER_HOSTS` resolve to the given
   addresses and ports (like curl --resolve; a list rotates per lookup);
5. answers requests, one JSON object per line: `{"id", "module", "function", "arguments",
   "named"?, "own"?}` -> `{"id", "ok": true, "result", "refused", "rss_mb"}` or `{"id", "ok":
   false, "error": {"kind", "type", "status"}, "refused", "rss_mb"}`. An error never carries the
   exception's message (it may quote a secret). After a MemoryError the answer says
   `"exiting": true` and the worker exits, so the pool starts a fresh one.

The hook holds Python-level sockets and processes: a library's own native code (or ctypes)
could go around it. It holds every mainstream HTTP client; it is not a sandbox for hostile code.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import ipaddress
import itertools
import json
import os
import socket
import sys
import unicodedata
import urllib.error
from collections.abc import Iterator
from typing import Any

ENV_ALLOW_PRIVATE = "LOOPLINE_WORKER_ALLOW_PRIVATE"
ENV_HOSTS = "LOOPLINE_WORKER_HOSTS"
ENV_MEMORY_MB = "LOOPLINE_WORKER_MEMORY_MB"
ENV_PATH = "LOOPLINE_WORKER_PATH"

#: The error kinds of an answer (the pool checks answers against this set).
ERROR_KINDS = frozenset(
    {
        "refused",
        "http_status",
        "timeout",
        "connection",
        "import",
        "invalid_arguments",
        "memory",
        "error",
        "invalid_request",
    }
)
#: What the policy refuses, as reported in an answer's "refused" list.
REFUSAL_KINDS = frozenset(
    {
        "unspecified",
        "loopback",
        "link-local",
        "multicast",
        "private",
        "reserved",
        "unix",
        "non-IP",
        "host name",
        "model-chosen host",
        "process",
    }
)

_CONNECT_EVENTS = frozenset({"socket.connect", "socket.sendto", "socket.sendmsg"})
_PROCESS_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "pty.spawn",
    }
)
_REFUSED_WHAT = {
    "unix": "a unix socket",
    "non-IP": "a non-IP socket",
    "host name": "an unresolved host name",
    "model-chosen host": "a host the model named",
}
# Kept while the worker runs and freed on a MemoryError, so the answer can still be written.
_MEMORY_RESERVE_BYTES = 1 << 20


class RefusedByPolicy(ConnectionRefusedError):
    """A connection the outbound policy refuses. A ConnectionRefusedError, so every library
    treats it as a failed connection; its message names only the kind of destination."""

    def __init__(self, kind: str) -> None:
        what = _REFUSED_WHAT.get(kind) or f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} address"
        super().__init__(errno.ECONNREFUSED, f"the outbound policy refuses {what}")
        self.kind = kind


class ProcessRefused(PermissionError):
    """Process creation, which the worker refuses (a child would not carry the audit hook)."""

    def __init__(self) -> None:
        super().__init__(errno.EPERM, "the outbound policy refuses process creation")
        self.kind = "process"


def classify(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why `address` is not a public destination ("loopback", "private", ...), or None if it is.

    A copy of services/tools/netpolicy.py's `classify` (this script cannot import it; a test
    checks they agree). IPv4-mapped, 6to4 and Teredo IPv6 addresses are judged by the IPv4
    address they carry.
    """
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        elif address.sixtofour is not None:
            address = address.sixtofour
        elif address.teredo is not None:
            address = address.teredo[1]
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if address.is_private:
        return "private"
    if address.is_reserved or not address.is_global:
        return "reserved"
    return None


def parse_hosts(raw: str) -> dict[str, list[tuple[str, int | None]]]:
    """The name overrides of a LOOPLINE_WORKER_HOSTS value: host -> [(address, port or None)].

    The value is a JSON object mapping a host name to "ip", "ip:port", "[v6]:port" or a list
    of those. Raises ValueError on anything else (an operator's mistake shows at start).
    """
    if not raw.strip():
        return {}
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("the worker hosts must be a JSON object")
    hosts: dict[str, list[tuple[str, int | None]]] = {}
    for host, value in data.items():
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(item, str) for item in values):
            raise ValueError(f"worker host {host!r}: give an address or a list of addresses")
        hosts[_host_key(host)] = [_parse_target(host, item) for item in values]
    return hosts


def _parse_target(host: str, text: str) -> tuple[str, int | None]:
    """(address, port or None) of "ip", "ip:port" or "[v6]:port"; ValueError otherwise."""
    address, port = text, None
    if text.startswith("["):
        address, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"worker host {host!r}: {text!r} is not [address]:port")
        port = int(rest[1:]) if rest else None
    elif text.count(":") == 1:
        address, _, port_text = text.partition(":")
        port = int(port_text)
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise ValueError(f"worker host {host!r}: {address!r} is not an IP address") from None
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"worker host {host!r}: port {port} is out of range")
    return address, port


def _strings(value: Any) -> list[str]:
    """`value` if it is a list of strings, else [] (a request's optional host lists)."""
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    return []


# the dots a resolver or an IDNA encoder takes for "." (UTS 46 maps them; NFKC alone does not)
_DOTS = str.maketrans({"\u3002": ".", "\uff0e": ".", "\uff61": "."})


def canonical_host(host: Any) -> str:
    """`host` (a name or an address) the way a client connects to it: an IPv4 address in any
    notation inet_aton takes (2130706433, 0x7f000001, 0177.1) and an IPv6 one (an IPv4-mapped one
    as its IPv4 address) as its standard text; a name lower-cased, its Unicode dots made dots
    and IDNA-encoded (еvil.test -> xn--vil-qdd.test), without a trailing dot."""
    text = _host_key(host).strip("[]")
    text = unicodedata.normalize("NFKC", text).translate(_DOTS).rstrip(".")
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        address = None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    if address is not None:
        return str(address)
    if text and all(c in "0123456789abcdefx." for c in text):
        try:
            return socket.inet_ntoa(socket.inet_aton(text))
        except OSError:
            pass
    try:
        return text.encode("idna").decode("ascii")
    except UnicodeError:
        return text


def _host_key(host: Any) -> str:
    """A host name as the hosts map keys it: text, lower case, no trailing dot."""
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    return str(host).lower().rstrip(".")


class Policy:
    """The outbound policy of this worker and the refusals of the call in progress."""

    def __init__(self, allow_private: bool) -> None:
        self.allow_private = allow_private
        self.refused: list[str] = []  # kinds refused during the current call, first time each
        # The current call's hosts named by the model, and the integration's own hosts: with a
        # credential, an action may not connect to the first unless it is one of the second (a
        # model steering the credential to a host of its choice). Empty: no such rule.
        self.named: frozenset[str] = frozenset()
        self.own: tuple[str, ...] = ()

    def judge_name(self, host: Any) -> str | None:
        """ "model-chosen host" when `host` (a name or an address) is one the model named, or
        below one, and not the integration's own (or below it); None otherwise."""
        if not self.named or host is None:
            return None
        name = canonical_host(host)
        if any(name == own or name.endswith("." + own) for own in self.own):
            return None
        if any(name == named or name.endswith("." + named) for named in self.named):
            return "model-chosen host"
        return None

    def judge(self, family: int, address: Any) -> str | None:
        """The refusal kind of a connection of `family` to `address`, or None if allowed."""
        if family == getattr(socket, "AF_UNIX", None):
            return "unix"
        if family not in (socket.AF_INET, socket.AF_INET6):
            return "non-IP"
        host = address[0] if isinstance(address, tuple) and address else None
        if isinstance(host, bytes):
            host = host.decode("ascii", "replace")
        try:
            ip = ipaddress.ip_address(str(host).split("%", 1)[0])
        except ValueError:
            # A name resolved by the C library, past the policy and the hosts map.
            return None if self.allow_private else "host name"
        return None if self.allow_private else classify(ip)

    def refuse(self, error: RefusedByPolicy | ProcessRefused) -> None:
        """Record `error`'s kind for the current call's answer and raise it."""
        if error.kind not in self.refused:
            self.refused.append(error.kind)
        raise error

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        """The audit hook: refuse connections and process creation the policy does not allow."""
        if event in _CONNECT_EVENTS:
            sock, address = args[0], args[1]
            if address is None:  # sendmsg on a connected socket: judged at connect
                return
            kind = self.judge(sock.family, address)
            if kind is None and isinstance(address, tuple) and address:
                kind = self.judge_name(address[0])  # an address literal the model named
            if kind is not None:
                self.refuse(RefusedByPolicy(kind))
        elif event in _PROCESS_EVENTS:
            self.refuse(ProcessRefused())

    def install(self) -> None:
        """Install the hook (for the life of the process: audit hooks cannot be removed) and
        close `_posixsubprocess.fork_exec`, the one way to start a process without an event
        (multiprocessing's spawn and forkserver use it)."""
        sys.addaudithook(self.audit)
        resolve = socket.getaddrinfo

        def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
            kind = self.judge_name(host)
            if kind is not None:
                self.refuse(RefusedByPolicy(kind))
            return resolve(host, *args, **kwargs)

        socket.getaddrinfo = getaddrinfo  # outermost: before the hosts map answers
        try:
            import _posixsubprocess
        except ImportError:
            return

        def fork_exec(*_args: Any, **_kwargs: Any) -> Any:
            self.refuse(ProcessRefused())

        _posixsubprocess.fork_exec = fork_exec  # type: ignore[attr-defined,unused-ignore]


def install_resolver(hosts: dict[str, list[tuple[str, int | None]]]) -> None:
    """Make `socket.getaddrinfo` resolve the hosts of `hosts` to their listed addresses, one
    per lookup in rotation (every library's lookups go through it: asyncio, anyio, urllib3,
    http.client). Other names resolve as usual.

    A listed port replaces the requested one in the answer; since some clients (anyio, so
    httpx) keep the requested port and use only the answer's address, a connection to that
    address and the requested port goes to the listed port too (like curl --connect-to).
    """
    if not hosts:
        return
    real = socket.getaddrinfo
    rotations: dict[str, Iterator[tuple[str, int | None]]] = {
        host: itertools.cycle(targets) for host, targets in hosts.items()
    }
    ports: dict[tuple[str, int], int] = {}  # (address, requested port) -> listed port

    def getaddrinfo(
        host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0
    ) -> Any:
        rotation = rotations.get(_host_key(host)) if host is not None else None
        if rotation is None:
            return real(host, port, family, type, proto, flags)
        address, listed = next(rotation)
        numeric = flags | socket.AI_NUMERICHOST
        answer = real(address, port if listed is None else listed, family, type, proto, numeric)
        requested = _port_number(port)
        if listed is not None and requested is not None:
            for *_, sockaddr in answer:
                ports[(str(sockaddr[0]), requested)] = listed
        return answer

    def redirected(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple):
            listed = ports.get((address[0], address[1])) if len(address) >= 2 else None
            if listed is not None:
                return (address[0], listed, *address[2:])
        return address

    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def connect_to(self: socket.socket, address: Any) -> None:
        connect(self, redirected(self, address))

    def connect_ex_to(self: socket.socket, address: Any) -> int:
        return connect_ex(self, redirected(self, address))

    socket.getaddrinfo = getaddrinfo
    socket.socket.connect = connect_to  # type: ignore[method-assign,assignment]
    socket.socket.connect_ex = connect_ex_to  # type: ignore[method-assign,assignment]


def _port_number(port: Any) -> int | None:
    """A getaddrinfo port argument (number, digits or service name) as a number, or None."""
    if isinstance(port, bytes):
        port = port.decode("ascii", "replace")
    if isinstance(port, int):
        return port
    if isinstance(port, str):
        try:
            return int(port) if port.isdigit() else socket.getservbyname(port)
        except OSError:
            return None
    return None


def rss_mb() -> float:
    """This process's resident memory in MiB (its peak where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            pages = int(statm.read().split()[1])
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def limit_memory(memory_mb: int) -> None:
    """Cap the address space at `memory_mb` MiB (soft and hard: the worker cannot raise it)."""
    if memory_mb <= 0:
        return
    import resource

    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class _Missing(Exception):
    """The requested function is not in its module (answered as kind "import")."""


class _BadArguments(Exception):
    """The arguments do not fit the function's signature (answered as "invalid_arguments")."""


class Runner:
    """Resolves a request's module and function (modules cached by `import`) and calls it."""

    async def run(self, module: str, function: str, arguments: dict[str, Any]) -> Any:
        """The result of `module.function` called with `arguments`: a LangChain tool through
        `ainvoke`, a coroutine function awaited, a plain callable called."""
        import importlib

        target = getattr(importlib.import_module(module), function, None)
        if target is None or function.startswith("_"):
            raise _Missing()
        if callable(getattr(target, "ainvoke", None)):
            return await target.ainvoke(arguments)
        if not callable(target):
            raise _Missing()
        try:
            inspect.signature(target).bind(**arguments)
        except TypeError:
            raise _BadArguments() from None
        except ValueError:  # no signature (a builtin): let the call say
            pass
        result = target(**arguments)
        if inspect.isawaitable(result):
            result = await result
        return result


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and its causes and contexts (each once, a bounded number)."""
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < 64:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def _class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of an error that carries a response (httpx, requests, urllib)."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if status is None and isinstance(exc, urllib.error.HTTPError):
        status = exc.code
    return status if isinstance(status, int) and 100 <= status <= 599 else None


def error_kind(exc: BaseException, refused: list[str]) -> tuple[str, int | None]:
    """(kind, HTTP status or None) of a failed call: what went wrong, never its message."""
    chain = list(_chain(exc))
    if any(isinstance(e, (RefusedByPolicy, ProcessRefused)) for e in chain):
        return "refused", None
    if any(isinstance(e, MemoryError) for e in chain):
        return "memory", None
    for e in chain:
        status = _http_status(e)
        if status is not None:
            return "http_status", status
    names = set().union(*(_class_names(e) for e in chain))
    if isinstance(exc, (_Missing, ImportError)):
        return "import", None
    if isinstance(exc, _BadArguments) or (
        "ValidationError" in names and any(type(e).__module__.startswith("pydantic") for e in chain)
    ):
        return "invalid_arguments", None
    if any(isinstance(e, TimeoutError) for e in chain) or any("Timeout" in n for n in names):
        return "timeout", None
    connection = ("ConnectError", "ConnectionError", "NetworkError", "SSLError", "gaierror")
    if any(isinstance(e, ConnectionError) for e in chain) or names & set(connection):
        # a library that swallows the policy's exception (asyncio's "Multiple exceptions")
        return ("refused" if refused else "connection"), None
    if any(isinstance(e, ImportError) for e in chain):
        return "import", None
    return ("refused" if refused and "OSError" in names else "error"), None


def _json_default(value: Any) -> Any:
    """JSON for what json cannot encode: a pydantic model's JSON form, else its text."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        try:
            return dump(mode="json")
        except Exception:  # noqa: BLE001 - any failure falls back to the text form
            pass
    return str(value)


class Worker:
    """The request loop: one call at a time, answers on the private protocol stream."""

    def __init__(self, policy: Policy, answers: Any, requests: Any) -> None:
        self.policy = policy
        self.answers = answers
        self.requests = requests
        self.runner = Runner()
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.reserve: bytearray | None = bytearray(_MEMORY_RESERVE_BYTES)

    def send(self, answer: dict[str, Any]) -> None:
        """Write one answer line and flush it."""
        self.answers.write(json.dumps(answer, default=_json_default).encode() + b"\n")
        self.answers.flush()

    def handle(self, line: bytes) -> bool:
        """Run the request of `line` and answer it; False when the worker must exit."""
        try:
            request = json.loads(line)
            call_id = request["id"]
            module, function = str(request["module"]), str(request["function"])
            arguments = request.get("arguments") or {}
            if not isinstance(arguments, dict):
                raise TypeError("arguments")
        except (ValueError, KeyError, TypeError):
            self.send({"id": None, "ok": False, "error": {"kind": "invalid_request"}})
            return True
        self.policy.refused = []
        self.policy.named = frozenset(canonical_host(h) for h in _strings(request.get("named")))
        self.policy.own = tuple(canonical_host(h) for h in _strings(request.get("own")))
        try:
            result = self.loop.run_until_complete(self.runner.run(module, function, arguments))
            answer: dict[str, Any] = {"id": call_id, "ok": True, "result": result}
        except BaseException as exc:  # noqa: BLE001 - every failure of an action is answered
            self.reserve = None if isinstance(exc, MemoryError) else self.reserve
            kind, status = error_kind(exc, self.policy.refused)
            error = {"kind": kind, "type": type(exc).__name__[:100], "status": status}
            answer = {"id": call_id, "ok": False, "error": error}
            del exc
        exiting = answer.get("error", {}).get("kind") == "memory"
        answer.update(refused=list(self.policy.refused), rss_mb=rss_mb(), exiting=exiting)
        try:
            self.send(answer)
        except (TypeError, ValueError, RecursionError):  # a result JSON cannot hold
            error = {"kind": "error", "type": "UnencodableResult", "status": None}
            self.send({**answer, "ok": False, "result": None, "error": error})
        return not exiting

    def serve(self) -> None:
        """Answer requests until stdin ends (the pool closed it) or the worker must exit."""
        self.send({"ready": True, "pid": os.getpid(), "rss_mb": rss_mb()})
        while True:
            line = self.requests.readline()
            if not line:
                return
            if line.strip() and not self.handle(line):
                return


def _private_streams() -> tuple[Any, Any]:
    """(requests, answers): private copies of stdin and stdout; fd 0 becomes /dev/null and
    fd 1 a copy of fd 2, for whatever integration code reads or prints."""
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    return requests, answers


def main() -> None:
    """Run the worker (configuration from LOOPLINE_WORKER_*); the exit status."""
    requests, answers = _private_streams()
    limit_memory(int(os.environ.get(ENV_MEMORY_MB) or 0))
    allow_private = os.environ.get(ENV_ALLOW_PRIVATE, "false").strip().lower() == "true"
    hosts = parse_hosts(os.environ.get(ENV_HOSTS, ""))
    sys.path.extend(p for p in os.environ.get(ENV_PATH, "").split(os.pathsep) if p)
    policy = Policy(allow_private)
    install_resolver(hosts)
    policy.install()
    Worker(policy, answers, requests).serve()
    answers.flush()
    os._exit(0)  # no interpreter teardown: integration code's atexit work is not waited for


if __name__ == "__main__":
    main()
