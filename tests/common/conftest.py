"""Fixtures of the tests of rules every service applies.

The tools-layer cases of the JSON rules start the tools service alone and fetch from a local
HTTP server (the fixtures of tests/tools/conftest.py); `fixtures` hands a case all it may use.
"""

import pytest

from tests.common.layers import Fixtures
from tests.tools.conftest import StartTools, local_http, start_tools

__all__ = ["fixtures", "local_http", "start_tools"]


@pytest.fixture
def fixtures(tmp_path, monkeypatch, start_tools: StartTools, local_http: str) -> Fixtures:
    """What a layer's case may use (see tests/common/layers.py)."""
    return Fixtures(tmp_path, monkeypatch, start_tools, local_http)
