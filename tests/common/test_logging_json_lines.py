"""What Python itself would print over several lines is logged as one JSON line instead.

After `services.common.logging.setup`, a warning, an exception a thread did not catch, one
Python could only ignore (raised in `__del__`) and one nothing caught at all are each a record
of the service's JSON log, its traceback inside the line; stderr holds nothing else. gRPC's C
core, which writes plain text, is silent unless GRPC_VERBOSITY is set (services/grpc_core.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import orjson

from services import grpc_core

PROGRAM = textwrap.dedent(
    """
    import threading, warnings
    from services.common import logging as loopline_logging

    loopline_logging.setup("demo")
    warnings.warn("careful:\\nthis spans two lines")

    def fail():
        raise ValueError("in a thread")

    thread = threading.Thread(target=fail)
    thread.start()
    thread.join()

    class Leaky:
        def __del__(self):
            raise KeyError("in __del__")

    Leaky()
    raise RuntimeError("nothing caught this:\\nsecond line")
    """
)


def test_warnings_and_uncaught_exceptions_are_one_json_line_each():
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 1
    lines = [orjson.loads(line) for line in result.stderr.splitlines()]
    assert [(line["service"], line["logger"], line["level"]) for line in lines] == [
        ("demo", "py.warnings", "warning"),
        ("demo", "uncaught", "critical"),
        ("demo", "uncaught", "critical"),
        ("demo", "uncaught", "critical"),
    ]
    assert "this spans two lines" in lines[0]["message"]
    assert [line.get("exc_type") for line in lines[1:]] == [
        "ValueError",
        "KeyError",
        "RuntimeError",
    ]
    assert all("Traceback" in line["traceback"] for line in lines[1:])
    assert "nothing caught this:\nsecond line" in lines[3]["traceback"]


def test_grpcs_own_plain_text_log_is_off_unless_the_operator_sets_it():
    environ: dict[str, str] = {}
    assert grpc_core.quiet(environ) is True and environ == {"GRPC_VERBOSITY": "NONE"}
    for chosen in ("ERROR", ""):  # an operator's choice is theirs
        environ = {"GRPC_VERBOSITY": chosen}
        assert grpc_core.quiet(environ) is False and environ == {"GRPC_VERBOSITY": chosen}
