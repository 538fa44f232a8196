"""`make run` (scripts/dev.py) explains a setup mistake instead of printing a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.e2e.conftest import ROOT, free_port


def test_a_data_dir_that_is_a_file_is_explained(tmp_path):
    # LOOPLINE_DATA_DIR naming a regular file is a one-line error, not NotADirectoryError's
    # traceback
    not_a_folder = tmp_path / "data"
    not_a_folder.write_text("a file")
    env = {**os.environ, "LOOPLINE_DATA_DIR": str(not_a_folder)}
    for name in ("HTTP", "GATEWAY_GRPC", "ORCHESTRATOR", "BILLING", "TOOLS"):
        env[f"LOOPLINE_{name}_PORT"] = str(free_port())
    result = subprocess.run(
        [sys.executable, "scripts/dev.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert (
        "LOOPLINE_DATA_DIR must be a folder" in result.stderr
        and "Traceback" not in result.stderr + result.stdout
    )
