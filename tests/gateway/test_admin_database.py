"""`python -m services.gateway` admin commands pointed at a database they cannot use answer one
JSON error naming it (exit 1), never a traceback or the URL's password."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ADMIN_COMMANDS = (
    ("seed-dev",),
    ("add-member", "--org", "acme", "--role", "owner"),
    ("list-keys", "--org", "acme"),
    ("revoke-key", "--key-id", "key_x"),
    (
        "set-default-llm",
        "--org",
        "acme",
        "--integration",
        "openai",
        "--provider",
        "openai",
        "--model",
        "gpt-4.1",
    ),
    ("show-default-llm", "--org", "acme"),
)


def _gateway(*runs: tuple[dict[str, str], tuple[str, ...]]) -> list[tuple[int, dict]]:
    """[(exit code, the JSON on stdout)] of `python -m services.gateway ARGV` for each (env, argv)
    of `runs`, run side by side; each is checked to print no traceback."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "services.gateway", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env, argv in runs
    ]
    answers = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert "Traceback" not in err, err
        answers.append((process.returncode, json.loads(out)))
    return answers


def _env(**values: str) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")},
        "LOOPLINE_LOG_LEVEL": "WARNING",
        **values,
    }


def test_every_admin_command_answers_a_file_that_is_not_a_database_as_json(tmp_path):
    """With LOOPLINE_DATA_DIR holding a gateway.db of garbage, every admin command answers
    one JSON error naming the file (exit 1), not sqlalchemy's DatabaseError traceback."""
    (tmp_path / "gateway.db").write_bytes(os.urandom(4096))
    answers = _gateway(
        *((_env(LOOPLINE_DATA_DIR=str(tmp_path)), command) for command in ADMIN_COMMANDS)
    )
    for command, (code, document) in zip(ADMIN_COMMANDS, answers, strict=True):
        assert code == 1, command
        assert document == {
            "error": f"the gateway database at {tmp_path / 'gateway.db'} cannot be used:"
            " the file is not a "
            "SQLite database (it lacks the SQLite header); run admin commands with the "
            "LOOPLINE_DATA_DIR (or LOOPLINE_GATEWAY_DATABASE_URL) the services use"
        }, command


def test_a_folder_a_data_directory_that_is_a_file_and_a_bad_url_are_json_errors(tmp_path):
    """The kind of fault behind the garbage file: the database is a folder, LOOPLINE_DATA_DIR is a
    file (seed-dev creates the database), the URL is malformed or its server refuses."""
    (tmp_path / "folder" / "gateway.db").mkdir(parents=True)
    (tmp_path / "a_file").write_text("not a folder")
    refused = "postgresql+asyncpg://admin:pa55word-x@127.0.0.1:1/identity"
    folder, data_dir_file, data_dir_file_listed, bad_url, no_server = _gateway(
        (_env(LOOPLINE_DATA_DIR=str(tmp_path / "folder")), ("list-keys", "--org", "acme")),
        (_env(LOOPLINE_DATA_DIR=str(tmp_path / "a_file")), ("seed-dev",)),
        (
            _env(LOOPLINE_DATA_DIR=str(tmp_path / "a_file")),
            ("list-keys", "--org", "acme"),
        ),  # said "no gateway database at"
        (_env(LOOPLINE_GATEWAY_DATABASE_URL="not a url"), ("list-keys", "--org", "acme")),
        (
            _env(LOOPLINE_GATEWAY_DATABASE_URL=refused),
            ("add-member", "--org", "acme", "--role", "owner"),
        ),
    )
    assert folder[0] == 1 and "it is a folder, not a database file" in folder[1]["error"]
    assert (
        data_dir_file[0] == 1
        and f"its folder {tmp_path / 'a_file'} is a file" in data_dir_file[1]["error"]
    )
    assert (
        data_dir_file_listed[0] == 1
        and f"its folder {tmp_path / 'a_file'} is a file" in data_dir_file_listed[1]["error"]
    )
    assert (
        bad_url[0] == 1
        and "LOOPLINE_GATEWAY_DATABASE_URL is not a database URL" in bad_url[1]["error"]
    )
    assert (
        no_server[0] == 1
        and "(postgresql database 'identity' on 127.0.0.1:1) cannot be used"
        in no_server[1]["error"]
    )
    assert "pa55word-x" not in json.dumps(no_server[1])


def test_only_errors_of_an_unusable_database_are_answered(tmp_path):
    """`db.unusable_database` answers the database's own faults and leaves every other error to
    propagate (a constraint conflict has its own answer; a bug must not pass for a database
    error)."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    from services.common import db

    url = f"sqlite+aiosqlite:///{tmp_path / 'data' / 'gateway.db'}"
    args = ("gateway", "LOOPLINE_GATEWAY_DATABASE_URL")
    conflict = IntegrityError("INSERT ...", {}, Exception("UNIQUE constraint failed: users.email"))
    assert db.unusable_database(conflict, url, *args) is None
    assert db.unusable_database(RuntimeError("a bug"), url, *args) is None
    assert (
        db.unusable_database(
            FileNotFoundError(2, "No such file or directory", str(tmp_path / "plans.toml")),
            url,
            *args,
        )
        is None
    )
    locked = OperationalError(
        "SELECT ... WHERE secret = ?",
        {"secret": "s3cr3t-value"},
        Exception("database is locked\nmore"),
    )
    answer = db.unusable_database(locked, url, *args)
    assert (
        answer is not None
        and "database is locked" in answer
        and "s3cr3t-value" not in answer
        and "SELECT" not in answer
    )
    mkdir = FileExistsError(17, "File exists", str(tmp_path / "data"))
    assert "File exists" in (db.unusable_database(mkdir, url, *args) or "")
