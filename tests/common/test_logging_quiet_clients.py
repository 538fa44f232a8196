"""HTTP client libraries never log the URLs they call (maybe secret) at the services' levels."""

from __future__ import annotations

import logging

import pytest

from services.common import logging as loopline_logging


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in loopline_logging.QUIET_LOGGERS}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, value in levels.items():
        logging.getLogger(name).setLevel(value)


@pytest.mark.parametrize("name", ["httpx", "httpx2", "httpcore.http11", "httpcore2.connection"])
def test_a_client_library_request_line_with_a_secret_url_is_not_logged(
    capsys, restore_logging, name
):
    """A request line such as `HTTP Request: POST http://…/mcp?token=QUERYSECRET` (the mcp
    SDK's httpx2 when an MCP server is registered) is never logged."""
    loopline_logging.setup("tools", "DEBUG")
    logging.getLogger(name).info(
        'HTTP Request: POST http://1.1.1.1:9/mcp?token=QUERYSECRET "HTTP/1.1 404 Not Found"'
    )
    logging.getLogger(name).warning("a warning still shows")
    err = capsys.readouterr().err
    assert "QUERYSECRET" not in err and "a warning still shows" in err
