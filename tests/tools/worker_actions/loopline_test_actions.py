"""Actions the worker tests run inside integration workers (under the integrations interpreter,
imported through LOOPLINE_WORKER_PATH): results, failures, crashes, hangs, leaks, and clients
that try to connect or to start a process, so the tests can watch the pool and the policy."""

from __future__ import annotations

import asyncio
import datetime
import os
import pathlib
import socket
import time
from typing import Any

_kept: list[bytearray] = []  # what `leak` allocates stays reachable


def echo(**arguments: Any) -> dict[str, Any]:
    """The arguments back, with the worker's pid and a value JSON cannot hold as is."""
    return {"echo": arguments, "pid": os.getpid(), "when": datetime.date(2024, 1, 2)}


async def async_echo(text: str) -> dict[str, Any]:
    """A coroutine function: `text` back."""
    await asyncio.sleep(0)
    return {"text": text, "pid": os.getpid()}


def pid() -> int:
    """The worker's pid."""
    return os.getpid()


def environment() -> dict[str, str]:
    """The worker's whole environment."""
    return dict(os.environ)


def fail_with_secret(secret: str) -> None:
    """Raise an exception whose message quotes `secret`."""
    raise ValueError(f"upstream refused token {secret}")


def http_404() -> None:
    """Raise httpx's error for an HTTP 404 response (no network)."""
    import httpx

    request = httpx.Request("GET", "https://api.example.com/things/1")
    httpx.Response(404, request=request).raise_for_status()


def exit_now(code: int) -> None:
    """End the worker at once with status `code`."""
    os._exit(code)


def segfault() -> None:
    """Crash the worker with SIGSEGV (a read of address 0)."""
    import ctypes

    ctypes.string_at(0)


def sigkill() -> None:
    """Kill the worker with SIGKILL."""
    os.kill(os.getpid(), 9)


async def hang(marker: str) -> None:
    """Write the pid to `marker`, then wait (far) longer than any test's timeout."""
    _mark(marker)
    await asyncio.sleep(3600)


def _mark(marker: str) -> None:
    pathlib.Path(marker).write_text(str(os.getpid()))


def hang_blocking(marker: str) -> None:
    """`hang`, blocking the worker's thread instead of awaiting."""
    _mark(marker)
    time.sleep(3600)


def leak(chunk_mb: int) -> None:
    """Allocate `chunk_mb` MiB at a time, keeping each, until memory runs out."""
    while True:
        _kept.append(bytearray(chunk_mb * 2**20))


def rendezvous(directory: str, count: int) -> int:
    """Mark this call in `directory` and wait until `count` calls have (bounded); the pid."""
    pathlib.Path(directory, str(os.getpid())).touch()
    for _ in range(600):
        if len(os.listdir(directory)) >= count:
            return os.getpid()
        time.sleep(0.05)
    raise TimeoutError("the other calls never came")


async def connect(client: str, url: str) -> dict[str, Any]:
    """GET `url` (http://host:port/) with `client`; the status and body. Failures propagate."""
    host, _, port_text = url.removeprefix("http://").rstrip("/").rpartition(":")
    port = int(port_text)
    request = f"GET / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode()
    if client == "httpx":
        import httpx

        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.get(url)
        return {"status": response.status_code, "body": response.text}
    if client in ("requests", "urllib"):
        return _blocking_get(client, url)  # as catalogue actions do, inside a coroutine
    if client == "asyncio":
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request)
        data = await reader.read()
        writer.close()
        return {"status": int(data.split()[1]), "body": data.split(b"\r\n\r\n")[-1].decode()}
    if client == "socket":
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(request)
            data = b"".join(iter(lambda: sock.recv(65536), b""))
        return {"status": int(data.split()[1]), "body": data.split(b"\r\n\r\n")[-1].decode()}
    raise ValueError(client)


def _blocking_get(client: str, url: str) -> dict[str, Any]:
    """GET `url` with a blocking client: requests or urllib."""
    if client == "requests":
        import requests

        response = requests.get(url, timeout=10)
        return {"status": response.status_code, "body": response.text}
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return {"status": response.status, "body": response.read().decode()}


async def connect_caught(client: str, url: str) -> dict[str, Any]:
    """`connect`, answering a failure as a result the way many catalogue actions do."""
    try:
        return await connect(client, url)
    except Exception as exc:  # noqa: BLE001 - the point of this action
        return {"success": False, "error": str(exc)}


async def rebinding(client: str, host: str, port: int) -> dict[str, Any]:
    """Look `host` up once (as a check would), then connect to it by name with `client`; the
    address checked and the connection's outcome (the class of its error)."""
    first = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    try:
        return {"checked": first, **(await connect(client, f"http://{host}:{port}/"))}
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        return {"checked": first, "error": type(exc).__name__}


def connect_by_name(host: str, port: int) -> None:
    """Connect a raw socket to a host name (the C library would resolve it)."""
    with socket.socket() as sock:
        sock.connect((host, port))


def connect_unix(path: str) -> None:
    """Connect to the unix socket at `path`."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)


def spawn(how: str, marker: str) -> None:
    """Try to start a process that creates `marker`, the way `how` names."""
    if how == "subprocess":
        import subprocess

        subprocess.run(["touch", marker], check=True)
    elif how == "system":
        os.system(f"touch {marker}")
    elif how == "posix_spawn":
        os.posix_spawn("/usr/bin/touch", ["touch", marker], {})
    elif how == "fork":
        if os.fork() == 0:
            pathlib.Path(marker).touch()
            os._exit(0)
    elif how == "multiprocessing":
        import multiprocessing

        process = multiprocessing.get_context("spawn").Process(target=pathlib.Path(marker).touch)
        process.start()
        process.join()
