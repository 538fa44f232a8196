"""Stopping `make run` (scripts/dev.py) mid-turn, and what its logs hold.

Rules: a live listener's stream ends with `cancelled {reason: "shutdown"}` (the orchestrator
publishes it before the gateway stops); the seed step's output, with the plain dev API key,
stays out of gateway.log; the logs go under LOOPLINE_DATA_DIR; a start does not empty the
logs, so what a crashed run logged is kept when `make run` is started again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from tests.e2e.conftest import start_deployment, stop_deployment


def test_stopping_dev_mid_turn_ends_live_streams_with_cancelled_and_logs_hold_no_key(tmp_path):
    deployment = start_deployment(tmp_path)  # no --log-dir: the default follows LOOPLINE_DATA_DIR
    frames: list[dict] = []
    ended = threading.Event()
    try:
        with httpx.Client(
            base_url=deployment.base_url, headers=deployment.headers(), timeout=60
        ) as client:
            started = client.post(
                "/assistant/chat",
                json={"message": json.dumps({"script": [{"say": "late", "sleep_ms": 30000}]})},
            )
            assert started.status_code == 200, started.text
            stream_url = started.json()["stream_url"]

            def listen() -> None:
                try:
                    with client.stream("GET", stream_url) as response:
                        for line in response.iter_lines():
                            if line.startswith("data: "):
                                frames.append(json.loads(line[6:]))
                except httpx.HTTPError as error:
                    frames.append({"type": "broken", "error": repr(error)})
                finally:
                    ended.set()

            listener = threading.Thread(target=listen, daemon=True)
            listener.start()
            deadline = time.monotonic() + 20
            while not frames and time.monotonic() < deadline:
                time.sleep(0.05)
            assert frames and frames[0]["type"] == "metadata"
            os.killpg(deployment.process.pid, signal.SIGINT)
            assert ended.wait(40), "the stream did not end"
    finally:
        stop_deployment(deployment, timeout=60)
    types = [f["type"] for f in frames if f["type"] != "heartbeat"]
    assert types[-1] == "cancelled", frames
    assert frames[-1]["data"]["reason"] == "shutdown"
    logs = tmp_path / "var" / "logs"
    assert (logs / "gateway.log").exists() and (logs / "orchestrator.log").exists()
    for log in logs.iterdir():
        assert deployment.api_key not in log.read_text(errors="replace"), (
            f"the dev API key is in {log.name}"
        )
    first_run = {
        name: (logs / name).read_text(errors="replace")
        for name in ("gateway.log", "orchestrator.log")
    }
    stop_deployment(
        start_deployment(tmp_path), timeout=60
    )  # a second start on the same data directory
    for name, before in first_run.items():
        text = (logs / name).read_text(errors="replace")
        assert text.startswith(before) and text.count("===== make run started") == 2, name


def test_ctrl_c_with_the_output_piped_and_the_pipe_gone_still_stops_in_order(tmp_path):
    """`make run | tee log` and Ctrl-C (which stops tee too): the console goes quiet and dev.py
    stops the services in order; dying on the broken pipe would send every service its
    parent-death signal at once (billing could stop before the orchestrator ended its runs)."""
    deployment = start_deployment(tmp_path, piped=True)
    deployment.close_pipe()
    stop_deployment(deployment, timeout=60)
    assert deployment.process.returncode == 0
    logs = tmp_path / "var" / "logs"

    def stopped_at(name: str) -> str:
        times = []
        for line in (logs / f"{name}.log").read_text().splitlines():
            if '"message":"stopped"' in line:
                times.append(json.loads(line)["time"])
        return max(times)

    first = stopped_at("orchestrator")
    assert all(first < stopped_at(name) for name in ("gateway", "billing", "tools"))
