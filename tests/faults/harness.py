"""The fault suite's harness: a Redis server of the test's own, the whole cluster as processes,
SSE listeners that follow a run across reconnects, and scripts for long runs.

`FaultCluster` is tests/scale's `Cluster` (same spawning, same environment) with the Redis
URL of the test's own `RedisServer` instead of the shared test Redis, and with billing and
tools started as processes too (`spawn_billing`, `spawn_tools`), so that a fault never stalls
the test process itself. `FaultCluster.start_default` starts the shape every scenario uses:
orchestrators o1 and o2, gateway g1 -> o1 and gateway g2 -> o2 (and, for listeners that join
late, g3 -> o2). Settings: LOOPLINE_RUN_LEASE_S and LOOPLINE_REDIS_RETRY_S on the
orchestrators (`start_default`), LOOPLINE_HEARTBEAT_INTERVAL_S=1 on the gateways (tests/scale's
`spawn_gateway`), LOOPLINE_BILLING_DEFAULT_PLAN=team on billing (3,000 turns a minute: the load
scenario starts 500).

`Listener` is a client that reads a run's SSE stream the way a careful client does: every
frame is kept with the time it arrived (heartbeats included, for the wait bound); a stream
that ends with the "reconnect with ?after=N" `error` frame is listened to again from N (on
its own gateway, or the next one when that one answers 5xx or cannot be reached); each
connection is a `Segment`, judged by tests/faults/checker.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import re
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema

from services.common import db
from services.gateway import identity
from tests.conftest import SERVICES, postgres_databases, release_databases, script
from tests.scale.conftest import Cluster, Replica, free_port, wait_port
from tests.sse_client import validate_frame

REDIS_SERVER = "/usr/bin/redis-server"
HEARTBEAT_S = (
    1.0  # LOOPLINE_HEARTBEAT_INTERVAL_S of every gateway (tests/scale's spawn_gateway sets it)
)
RECONNECT = re.compile(r"reconnect with \?after=(\d+)$")
TERMINAL = frozenset({"done", "cancelled", "interrupted"})
RETRYABLE_STATUSES = frozenset({502, 503, 504})


# ---------------------------------------------------------------------------- Redis


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


# ---------------------------------------------------------------------------- the cluster


@dataclass
class _Pending:
    """A port chosen for a service started later (Cluster.env needs billing's and tools' ports)."""

    port: int


@dataclass
class FaultCluster(Cluster):
    """tests/scale's Cluster on the test's own Redis, with billing and tools as processes too."""

    redis: RedisServer | None = None
    gateways: list[Replica] = field(default_factory=list)
    orchestrators: list[Replica] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    upstream: dict[str, Replica] = field(default_factory=dict)  # gateway name -> its orchestrator

    def live_gateways(self) -> list[Replica]:
        """The gateways that run and whose orchestrator runs."""
        return [
            g
            for g in self.gateways
            if g.process.poll() is None
            and (g.name not in self.upstream or self.upstream[g.name].process.poll() is None)
        ]

    def env(self, **extra: str) -> dict[str, str]:
        """Cluster.env, with the test's own Redis (an `extra` LOOPLINE_REDIS_URL, e.g. a proxy,
        wins)."""
        assert self.redis is not None
        extra.setdefault("LOOPLINE_REDIS_URL", self.redis.url)
        extra.setdefault(
            "LOOPLINE_KEY_REQUESTS_PER_MINUTE", "0"
        )  # the load scenario is one key's thousands of requests
        return super().env(**extra)

    async def spawn_billing(self, **settings: str) -> Replica:
        """Billing as a process, on the port chosen when the cluster was made."""
        port = self.billing.port
        env = self.env(
            LOOPLINE_BILLING_PORT=str(port),
            LOOPLINE_BILLING_DATABASE_URL=self.urls["billing"],
            LOOPLINE_BILLING_DEFAULT_PLAN="team",
            **settings,
        )
        process, log = self._spawn("billing", "billing", env)
        replica = Replica("billing", port, process, log)
        self.replicas.append(replica)
        await wait_port(port, process, log)
        self.billing = replica  # type: ignore[assignment]
        return replica

    async def spawn_tools(self, **settings: str) -> Replica:
        """Tools as a process, on the port chosen when the cluster was made."""
        port = self.tools.port
        env = self.env(
            LOOPLINE_TOOLS_PORT=str(port),
            LOOPLINE_TOOLS_DATABASE_URL=self.urls["tools"],
            **settings,
        )
        process, log = self._spawn("tools", "tools", env)
        replica = Replica("tools", port, process, log)
        self.replicas.append(replica)
        await wait_port(port, process, log)
        self.tools = replica  # type: ignore[assignment]
        return replica

    async def start_default(
        self,
        *,
        lease_s: float = 6.0,
        redis_retry_s: float = 5.0,
        late_gateway: bool = False,
        orchestrator_redis_url: str | None = None,
        o1_settings: dict[str, str] | None = None,
        **orchestrator_settings: str,
    ) -> None:
        """billing + tools, orchestrators o1 and o2, gateways g1 -> o1 and g2 -> o2; with
        `late_gateway`, also g3 -> o2 for listeners that join late: a gateway serves every
        listener of a run from one shared upstream stream, so a late listener on g1 or g2 joins
        that copy, while one on g3 makes o2 read the run from Redis (or its archive).
        `o1_settings`: more LOOPLINE_* variables for o1 only (e.g. its database through a proxy)."""
        await asyncio.gather(self.spawn_billing(), self.spawn_tools())
        settings = {
            "LOOPLINE_RUN_LEASE_S": str(lease_s),
            "LOOPLINE_REDIS_RETRY_S": str(redis_retry_s),
            **orchestrator_settings,
        }
        if orchestrator_redis_url:
            settings["LOOPLINE_REDIS_URL"] = orchestrator_redis_url
        self.orchestrators = list(
            await asyncio.gather(
                self.spawn_orchestrator("o1", **{**settings, **(o1_settings or {})}),
                self.spawn_orchestrator("o2", **settings),
            )
        )
        plan = [("g1", self.orchestrators[0]), ("g2", self.orchestrators[1])]
        if late_gateway:
            plan.append(("g3", self.orchestrators[1]))
        self.gateways = list(
            await asyncio.gather(*(self.spawn_gateway(name, upstream) for name, upstream in plan))
        )
        self.upstream = {name: upstream for name, upstream in plan}
        self.started = time.monotonic()

    def client(self, gateway: Replica, **kwargs: Any) -> httpx.AsyncClient:
        """An HTTP client of `gateway` with the owner's credentials (`kwargs`: httpx options)."""
        options: dict[str, Any] = {"timeout": 30}
        options.update(kwargs)
        return httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{gateway.port}",
            headers={"Authorization": f"Bearer {self.api_key}", "X-Organization-ID": self.org_id},
            **options,
        )

    def logs(self, lines: int = 6, width: int = 400) -> str:
        """The last `lines` warnings and errors of each process's log (each cut to `width`
        characters), and where the whole logs are."""
        parts = [f"(whole logs in {self.tmp})"]
        for replica in self.replicas:
            if not replica.log.exists():
                continue
            notable = [
                line
                for line in replica.log.read_text(errors="replace").splitlines()
                if '"level":"warning"' in line or '"level":"error"' in line or "Traceback" in line
            ]
            if notable:
                parts.append(
                    f"--- {replica.name}: {len(notable)} warning/error lines, the last ones:"
                )
                parts += [f"    {line[:width]}" for line in notable[-lines:]]
        return "\n".join(parts)

    def grep_logs(self, needle: str) -> dict[str, int]:
        """{replica: how many log lines contain `needle`}."""
        found = {}
        for replica in self.replicas:
            if replica.log.exists():
                count = sum(
                    1
                    for line in replica.log.read_text(errors="replace").splitlines()
                    if needle in line
                )
                if count:
                    found[replica.name] = count
        return found


async def make_cluster(tmp_path: pathlib.Path) -> FaultCluster:
    """Fresh PostgreSQL databases (tests/conftest.py's pool), a Redis server of the test's own
    and an owner's API key; nothing of the services is started yet (`start_default`)."""
    redis = RedisServer(tmp_path / "redis")
    await redis.start()
    urls = await postgres_databases()
    engine = db.make_engine(urls["gateway"])
    org_id = f"org_{uuid.uuid4().hex[:12]}"
    try:
        owner = await identity.create_member(db.sessionmaker(engine), org_id, "owner")
    finally:
        await engine.dispose()
    prefix = f"llfault:{uuid.uuid4().hex[:8]}:"
    return FaultCluster(
        tmp_path,
        urls,
        prefix,
        _Pending(free_port()),
        _Pending(free_port()),  # type: ignore[arg-type]
        org_id,
        owner["api_key"],
        owner["user_id"],
        redis=redis,
    )


async def stop_cluster(cluster: FaultCluster) -> None:
    """Kill every process (the services, then Redis) and hand the databases back to the pool."""
    for replica in cluster.replicas:
        with contextlib.suppress(Exception):
            replica.kill()
    if cluster.redis is not None:
        cluster.redis.kill()
    release_databases([cluster.urls[s] for s in SERVICES])


# ---------------------------------------------------------------------------- scripts


SCRIPTED_PATH = (
    pathlib.Path(__file__).resolve().parents[2]
    / "services"
    / "orchestrator"
    / "providers"
    / "scripted.py"
)


def supports_chunk_ms() -> bool:
    """Whether the scripted model knows `chunk_ms` (a wait between streamed chunks)."""
    try:
        return '"chunk_ms"' in SCRIPTED_PATH.read_text()
    except OSError:
        return False


ECHO = "execute_integration_tool"


def echo_input(message: str) -> dict[str, Any]:
    return {"integration": "loopline", "action": "echo", "parameters": {"message": message}}


def wait_input(seconds: float) -> dict[str, Any]:
    return {"integration": "loopline", "action": "wait", "parameters": {"seconds": seconds}}


@dataclass
class Turn:
    """What a turn was started with: its script (the user message) and the answer it ends with."""

    message: str
    answer: str


def long_turn(seconds: float, label: str, tick_s: float = 1.0) -> Turn:
    """A run that streams for about `seconds` and then completes with a known answer.

    With `chunk_ms` in the scripted model: one `say` of one word a tick. Without it: a model
    step with `sleep_ms` and a `loopline.echo` tool call each tick (frames response_chunk,
    tool_call, tool_result), then the answer. Either way the loop is never idle for longer
    than a tick, so events keep flowing through a fault.
    """
    ticks = max(2, int(seconds / tick_s))
    answer_words = [f"{label}-{i}" for i in range(ticks)]
    if supports_chunk_ms():
        answer = " ".join(answer_words) + "."
        return Turn(
            script({"say": answer, "chunks": ticks, "chunk_ms": int(tick_s * 1000)}), answer
        )
    ticks = min(
        ticks, 45
    )  # LOOPLINE_RECURSION_LIMIT 100: a model call and a tool call are a step each
    tick_ms = int(seconds * 1000 / (ticks + 1))
    steps: list[dict[str, Any]] = [
        {
            "tool": ECHO,
            "input": echo_input(f"{label} tick {i}"),
            "say": f"Tick {i}. ",
            "sleep_ms": tick_ms,
        }
        for i in range(ticks)
    ]
    answer = f"The answer of {label}: " + " ".join(answer_words[:8]) + "."
    steps.append({"say": answer, "chunks": 4, "sleep_ms": tick_ms})
    return Turn(script(*steps), answer)


def short_turn(label: str, sleep_ms: int = 500, chunks: int = 4) -> Turn:
    answer = f"Short answer {label}: one two three four five six."
    return Turn(script({"say": answer, "chunks": chunks, "sleep_ms": sleep_ms}), answer)


@dataclass
class Run:
    """A started turn and what the checker should find at its end.

    `expect` is "completed" (its owner finished it: the answer is `turn.answer`) or "failed"
    (it was lost with its owner: error + done {error: true}, failed by the crash reaper)."""

    chat_id: str
    run_id: str
    turn: Turn
    expect: str = "completed"
    via: str = ""
    started_at: float = 0.0

    @property
    def url(self) -> str:
        return f"/assistant/chat/{self.chat_id}/listen/{self.run_id}"

    @property
    def turn_key(self) -> str:
        return f"{self.chat_id}:{self.run_id}"


async def start_turn(
    client: httpx.AsyncClient,
    turn: Turn,
    *,
    chat_id: str | None = None,
    via: str = "",
    attempts: int = 1,
) -> Run:
    """POST /assistant/chat; returns the Run (a 503 is retried `attempts` times in all)."""
    body: dict[str, Any] = {"message": turn.message}
    if chat_id:
        body["chat_id"] = chat_id
    for attempt in range(attempts):
        response = await client.post("/assistant/chat", json=body)
        if response.status_code == 503 and attempt + 1 < attempts:
            await asyncio.sleep(min(1.0, float(response.headers.get("retry-after", "1") or 1)))
            continue
        assert response.status_code == 200, (
            f"starting a turn through {via or client.base_url}: "
            f"{response.status_code} {response.text}"
        )
        data = response.json()
        return Run(data["chat_id"], data["run_id"], turn, via=via, started_at=time.monotonic())
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------- listeners


@dataclass
class Segment:
    """One connection of a listener: `?after=` it asked, the frames it got (heartbeats apart)."""

    gateway: str
    after: int
    frames: list[dict[str, Any]] = field(default_factory=list)
    heartbeats: int = 0
    max_gap: float = (
        0.0  # longest wait, from the request to the first byte, between frames, to the end
    )
    max_gap_at: float = 0.0  # when (seconds since the listener started) that wait ended
    ending: str = ""  # "terminal", "reconnect", "closed" (neither), "timeout", "error: ..."
    headers_s: float = 0.0  # from the request to the response's headers

    @property
    def reconnect_at(self) -> int | None:
        """N of a final "reconnect with ?after=N" error frame, else None."""
        if self.frames and self.frames[-1].get("type") == "error":
            match = RECONNECT.search(str(self.frames[-1].get("data", {}).get("message", "")))
            if match:
                return int(match.group(1))
        return None


@dataclass
class Listener:
    """Follows a run's stream through `gateways` (the first one first), reconnecting with
    `?after=N` when told to; `segments` are its connections (how each ended is judged by the
    checker), `problems` what the checker cannot see in them (a status that is not retryable,
    a frame that is not `data: <json>` or is off the schema, a listener still open at its
    deadline). A 502/503/504 or a refused connection is retried on the next gateway."""

    name: str
    run: Run
    gateways: Sequence[tuple[str, httpx.AsyncClient]]
    gap_limit_s: float = (
        30.0  # the client's own read timeout (longer than any wait the checker accepts)
    )
    segments: list[Segment] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    refused: list[str] = field(
        default_factory=list
    )  # retryable answers to (re)connects, for the report
    finished: bool = False
    began: float = field(default_factory=time.monotonic)
    ended_at: float | None = None
    task: asyncio.Task | None = None
    received_types: list[str] = field(
        default_factory=list
    )  # every frame's type as it came (all connections)

    @property
    def received(self) -> int:
        return len(self.received_types)

    @property
    def frames(self) -> list[dict[str, Any]]:
        """The frames as a client that stitches segments sees them (reconnect frames dropped)."""
        stitched: list[dict[str, Any]] = []
        for segment in self.segments:
            frames = segment.frames[:-1] if segment.reconnect_at is not None else segment.frames
            stitched.extend(frames)
        return stitched

    def start(self, delay: float = 0.0) -> Listener:
        self.task = asyncio.create_task(self._follow(delay), name=f"listener {self.name}")
        return self

    async def _follow(self, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        self.began = time.monotonic()
        after, index = 0, 0
        try:
            while True:
                name, client = self.gateways[index % len(self.gateways)]
                segment = Segment(name, after)
                try:
                    status, retry_after = await self._read(client, segment)
                except (httpx.TransportError, OSError) as error:  # refused, reset before the answer
                    if (
                        segment.frames or segment.heartbeats
                    ):  # broke mid-stream: the checker reports the segment
                        self.segments.append(segment)
                        segment.ending = f"error: {type(error).__name__}"
                        return
                    self.refused.append(f"{name}: {type(error).__name__}")
                    index += 1
                    await asyncio.sleep(0.5)
                    continue
                if status in RETRYABLE_STATUSES:
                    self.refused.append(f"{name}: {status}")
                    index += 1  # another gateway
                    await asyncio.sleep(min(retry_after, 1.0))
                    continue
                if status != 200:
                    self.problems.append(
                        f"{self.name}: GET {self.run.url}?after={after} through {name} "
                        f"answered {status}"
                    )
                    return
                self.segments.append(segment)
                if segment.ending == "terminal":
                    self.finished = True
                    return
                if segment.ending == "reconnect":
                    after = segment.reconnect_at or 0
                    await asyncio.sleep(0.2)
                    continue
                # "closed" (neither an end frame nor the reconnect frame) or "timeout" (no frame for
                # gap_limit_s: the client gave up): the checker reports the segment
                return
        finally:
            self.ended_at = time.monotonic()

    async def _read(self, client: httpx.AsyncClient, segment: Segment) -> tuple[int, float]:
        """Read one connection into `segment`; (status, Retry-After) of a refused one."""
        last = time.monotonic()

        def tick() -> None:
            nonlocal last
            now = time.monotonic()
            if now - last > segment.max_gap:
                segment.max_gap, segment.max_gap_at = now - last, now - self.began
            last = now

        timeout = httpx.Timeout(self.gap_limit_s, connect=10)
        try:
            async with client.stream(
                "GET",
                self.run.url,
                params={"after": segment.after} if segment.after else None,
                timeout=timeout,
            ) as response:
                segment.headers_s = time.monotonic() - last
                if response.status_code != 200:
                    await response.aread()
                    retry = response.headers.get("retry-after", "1")
                    return response.status_code, float(retry) if retry.replace(
                        ".", "", 1
                    ).isdigit() else 1.0
                buffer = b""
                async for chunk in response.aiter_bytes():
                    buffer += chunk
                    while b"\n\n" in buffer:
                        tick()
                        raw, buffer = buffer.split(b"\n\n", 1)
                        if not raw.startswith(b"data: ") or b"\n" in raw:
                            self.problems.append(
                                f"{self.name}: a frame that is not `data: <json>`: {raw[:200]!r}"
                            )
                            continue
                        frame = json.loads(raw[len(b"data: ") :])
                        try:
                            validate_frame(frame)
                        except jsonschema.ValidationError as error:
                            self.problems.append(
                                f"{self.name}: frame off schemas/sse-frame.json "
                                f"({error.message[:120]}): {raw[:200]!r}"
                            )
                        if frame.get("type") == "heartbeat":
                            segment.heartbeats += 1
                            continue
                        segment.frames.append(frame)
                        self.received_types.append(frame.get("type", ""))
                if buffer:
                    self.problems.append(
                        f"{self.name}: the stream ended inside a frame: {buffer[:200]!r}"
                    )
        except httpx.ReadTimeout:
            tick()
            segment.ending = "timeout"
            return 200, 0.0
        except (
            httpx.RemoteProtocolError
        ) as error:  # the connection dropped mid-response (a peer died)
            tick()
            if not (segment.frames or segment.heartbeats):
                raise
            segment.ending = f"error: {error}"
            return 200, 0.0
        tick()
        if segment.reconnect_at is not None:
            segment.ending = "reconnect"
        elif segment.frames and segment.frames[-1].get("type") in TERMINAL:
            segment.ending = "terminal"
        else:
            segment.ending = "closed"
        return 200, 0.0


async def wait_listeners(listeners: Sequence[Listener], timeout: float) -> list[str]:
    """Wait for the listeners to end; those still open after `timeout` seconds are cancelled
    and named (a listener that never ends is a failure of its own)."""
    tasks = [listener.task for listener in listeners if listener.task is not None]
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    hung = []
    for listener in listeners:
        if listener.task is not None and not listener.task.done():
            listener.task.cancel()
            with contextlib.suppress(BaseException):
                await listener.task
            frames = sum(len(s.frames) for s in listener.segments)
            hung.append(
                f"{listener.name}: still open {timeout:.0f} s later "
                f"({frames} frames in finished segments)"
            )
            listener.problems.append(hung[-1])
    for listener in listeners:
        if (
            listener.task is not None
            and listener.task.done()
            and not listener.task.cancelled()
            and listener.task.exception()
        ):
            listener.problems.append(
                f"{listener.name}: the listener crashed: {listener.task.exception()!r}"
            )
    return hung


async def wait_frames(
    listener: Listener, count: int, timeout: float = 20, kind: str | None = None
) -> None:
    """Wait until `listener` has received `count` frames (of type `kind`, when given; reconnect
    frames included), all its connections together."""
    deadline = time.monotonic() + timeout
    while (listener.received if kind is None else listener.received_types.count(kind)) < count:
        if listener.task is not None and listener.task.done():
            raise AssertionError(
                f"{listener.name}: ended with {listener.received_types} "
                f"before {count} {kind or 'frames'}: "
                f"{listener.problems}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{listener.name}: fewer than {count} {kind or 'frames'} after {timeout} s: "
                f"{listener.received_types}"
            )
        await asyncio.sleep(0.02)
