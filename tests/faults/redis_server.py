"""A `redis-server` process of the test's own for the fault suite: started empty on its own
port, killed, paused and resumed with signals, and restarted empty on the same port.
"""

from __future__ import annotations

import asyncio
import pathlib
import signal
import socket
import subprocess
import time

from tests.scale.conftest import free_port

REDIS_SERVER = "/usr/bin/redis-server"


class RedisServer:
    """A `redis-server` of one test: no persistence, its own folder, a fixed port.

    `kill()` is SIGKILL, `pause()`/`resume()` are SIGSTOP/SIGCONT, and `restart()` starts it
    again EMPTY on the same port (nothing is saved, and any file it left is removed first).
    """

    def __init__(self, directory: pathlib.Path, port: int | None = None) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        self.log = directory / "redis.log"
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self, timeout: float = 10) -> None:
        """Start the server and wait until it answers PING."""
        process = self._spawn()
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(self.ping):
            if process.poll() is not None:
                raise AssertionError(
                    f"redis-server exited with {process.returncode}:\n{self._log_tail()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"redis-server did not answer on port {self.port} within {timeout} s:\n"
                    f"{self._log_tail()}"
                )
            await asyncio.sleep(0.05)

    def _spawn(self) -> subprocess.Popen:
        """Empty the folder and launch the process: a Popen, which the synchronous `kill`,
        `pause` and `resume` signal and reap."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in ("dump.rdb", "appendonly.aof", "appendonlydir"):
            path = self.directory / leftover
            if path.is_dir():
                for item in path.iterdir():
                    item.unlink()
                path.rmdir()
            elif path.exists():
                path.unlink()
        process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                "--logfile",
                str(self.log),
                "--daemonize",
                "no",
                "--protected-mode",
                "no",
                "--maxclients",
                "10000",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        self.process = process
        self.paused = False
        return process

    def ping(self) -> bool:
        """Whether the server answers PING now (1 s at most)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL (everything it held is gone)."""
        if self.process is not None and self.process.poll() is None:
            if self.paused:
                self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing is answered."""
        assert self.process is not None and self.process.poll() is None
        self.process.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
        self.paused = False

    async def restart(self) -> None:
        """Start again, empty, on the same port (after `kill`)."""
        self.kill()
        await self.start()

    def _log_tail(self) -> str:
        return self.log.read_text()[-2000:] if self.log.exists() else "(no log)"
