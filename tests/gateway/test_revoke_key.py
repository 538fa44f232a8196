"""API keys can be revoked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.common.sqlite_driver import sqlite3
from services.gateway import identity
from services.gateway.identity import Authenticator, AuthError
from tests.conftest import NO_DATABASE


async def test_a_revoked_key_is_refused(services):
    member = await services.member("admin")
    auth = Authenticator(services.gateway.sessions, ttl_s=30.0)
    header = f"Bearer {member['api_key']}"
    assert (await auth.authenticate(header, services.org_id)).user_id == member["user_id"]
    revoked = await identity.revoke_key(services.gateway.sessions, key_id=member["key_id"])
    assert revoked is not None
    assert revoked["key_id"] == member["key_id"] and revoked["user_id"] == member["user_id"]
    again = await identity.revoke_key(
        services.gateway.sessions, key=member["api_key"]
    )  # by the key itself: same, idempotent
    assert again == revoked
    fresh = Authenticator(
        services.gateway.sessions, ttl_s=30.0
    )  # a gateway whose cache has expired
    try:
        await fresh.authenticate(header, services.org_id)
    except AuthError as error:
        assert error.status == 401
    else:
        raise AssertionError("a revoked key was accepted")
    assert await identity.revoke_key(services.gateway.sessions, key_id="key_nope") is None


def test_revoke_key_command(tmp_path):
    env = {**os.environ, "LOOPLINE_DATA_DIR": str(tmp_path)}

    def gateway(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "services.gateway", *args],
            env=env,
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
        )

    org = json.loads(gateway("seed-dev").stdout)["organization_id"]
    member = json.loads(gateway("add-member", "--org", org, "--role", "member").stdout)
    listed = gateway("list-keys", "--org", org)
    keys = {key["key_id"]: key for key in json.loads(listed.stdout)["keys"]}
    assert (
        keys[member["key_id"]]["prefix"] == member["api_key"][:12]
        and keys[member["key_id"]]["revoked_at"] is None
    )
    assert (
        keys[member["key_id"]]["role"] == "member" and len(keys) == 2
    )  # the dev owner's key and this one
    assert keys[member["key_id"]]["organization_id"] is None  # the CLI's keys are unbound
    assert keys[member["key_id"]]["expires_at"] is None
    assert member["api_key"] not in listed.stdout
    by_id = gateway("revoke-key", "--key-id", member["key_id"])
    assert by_id.returncode == 0 and json.loads(by_id.stdout)["key_id"] == member["key_id"]
    by_key = gateway("revoke-key", stdin=member["api_key"] + "\n")
    assert json.loads(by_key.stdout) == json.loads(by_id.stdout)
    assert member["api_key"] not in by_key.stdout + by_key.stderr
    unknown = gateway("revoke-key", "--key-id", "key_nope")
    assert unknown.returncode == 1 and json.loads(unknown.stdout) == {"error": "no such API key"}
    after = {
        key["key_id"]: key for key in json.loads(gateway("list-keys", "--org", org).stdout)["keys"]
    }
    assert after[member["key_id"]]["revoked_at"] == json.loads(by_id.stdout)["revoked_at"]
    missing = gateway("list-keys", "--org", "org_nope")
    assert missing.returncode == 1 and json.loads(missing.stdout) == {
        "error": "no organization 'org_nope'"
    }


def test_add_member_refuses_an_unusable_organization_id(tmp_path):
    # "" or a 20,000-character id creates no organization
    env = {**os.environ, "LOOPLINE_DATA_DIR": str(tmp_path)}
    subprocess.run(
        [sys.executable, "-m", "services.gateway", "seed-dev"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    for org in (
        "",
        "x" * 129,
        "two words",
        "org_ü",
        "org\u00a0x",
    ):  # an id the API could never reach (org_ü) is refused
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.gateway",
                "add-member",
                "--org",
                org,
                "--role",
                "owner",
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 2 and "organization id" in result.stderr


def test_seed_dev_refuses_an_unusable_dev_organization_id(tmp_path):
    # an organization id outside visible ASCII is refused: no header could name it
    gateway = _command({**os.environ, "LOOPLINE_DATA_DIR": str(tmp_path)})
    for bad in ("org_ü", "two words", "x" * 129):
        refused = gateway("seed-dev", LOOPLINE_DEV_ORG_ID=bad)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "visible ASCII" in json.loads(refused.stdout)["error"]
    assert not (tmp_path / "gateway.db").exists()  # refused before anything was written
    seeded = gateway("seed-dev", LOOPLINE_DEV_ORG_ID="org_laptop")
    assert seeded.returncode == 0 and json.loads(seeded.stdout)["organization_id"] == "org_laptop"


def _command(env: dict[str, str]):
    def gateway(
        *args: str, stdin: str | None = None, **extra_env: str
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "services.gateway", *args],
            env={**env, **extra_env},
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
        )

    return gateway


def test_a_taken_email_and_an_empty_key_are_json_errors(tmp_path):
    """add-member with an email that already exists, and revoke-key with nothing on standard
    input, answer a JSON error saying so: not sqlalchemy's IntegrityError traceback, nor "no such
    API key"."""
    gateway = _command({**os.environ, "LOOPLINE_DATA_DIR": str(tmp_path)})
    org = json.loads(gateway("seed-dev").stdout)["organization_id"]
    for email in (
        "dev@loopline.local",
        "new@example.test",
    ):  # seed-dev's user, and one added here first
        if email == "new@example.test":
            assert (
                gateway("add-member", "--org", org, "--role", "member", "--email", email).returncode
                == 0
            )
        taken = gateway("add-member", "--org", org, "--role", "admin", "--email", email)
        assert taken.returncode == 1, taken.stderr
        assert json.loads(taken.stdout) == {"error": f"a user with email {email!r} already exists"}
        assert "Traceback" not in taken.stderr
    keys = json.loads(gateway("list-keys", "--org", org).stdout)["keys"]
    assert sorted(key["role"] for key in keys) == [
        "member",
        "owner",
    ]  # nothing written by the refusals
    for stdin in ("", "\n", "   \n"):
        empty = gateway("revoke-key", stdin=stdin)
        assert empty.returncode == 1
        assert json.loads(empty.stdout) == {
            "error": "no API key given: write the key to standard input, or pass --key-id"
        }
    blank_id = gateway("revoke-key", "--key-id", "")
    assert blank_id.returncode == 1 and json.loads(blank_id.stdout) == {
        "error": "no key id given: --key-id is empty"
    }
    assert all(
        key["revoked_at"] is None
        for key in json.loads(gateway("list-keys", "--org", org).stdout)["keys"]
    )


async def test_revoke_key_without_a_key_is_refused():
    for key in ("", None):
        with pytest.raises(identity.AdminError, match="no API key given"):
            await identity.revoke_key(
                NO_DATABASE, key_id=None, key=key
            )  # refused before any database look-up


def test_any_unique_conflict_of_an_admin_command_is_a_json_error(tmp_path, capsys):
    """The kind of fault behind the taken email: a unique-constraint conflict no admin function
    foresaw (e.g. a concurrent insert) is {"error": ...} and exit 1, never a traceback or the
    database's text (it may quote values)."""
    from sqlalchemy.exc import IntegrityError

    from services.gateway import __main__ as admin
    from services.gateway.config import GatewaySettings

    async def conflicting(_sessions):
        raise IntegrityError(
            "INSERT INTO users ...",
            {"email": "x@example.test"},
            Exception("UNIQUE constraint failed: users.email"),
        )

    settings = GatewaySettings(data_dir=tmp_path)
    with pytest.raises(SystemExit) as exited:
        admin._run(settings, conflicting)
    assert exited.value.code == 1
    out = capsys.readouterr().out
    assert json.loads(out) == {"error": admin.CONFLICT} and "x@example.test" not in out


def test_a_short_dev_key_is_refused_and_a_listed_prefix_is_never_the_whole_key(tmp_path):
    """seed-dev refuses a dev key under 20 characters (or with spaces or non-ASCII characters)
    before writing anything, a stored prefix is at most a quarter of its key, and an older row
    with a longer prefix is never listed whole: list-keys must not show a whole key (`devkey`)."""
    gateway = _command({**os.environ, "LOOPLINE_DATA_DIR": str(tmp_path)})
    for bad in ("devkey", "x" * 19, "a dev key with spaces in it", "dev-key-with-ümlaut-123"):
        refused = gateway("seed-dev", LOOPLINE_DEV_API_KEY=bad)
        assert refused.returncode == 1, refused.stdout
        assert "at least 20 printable ASCII characters" in json.loads(refused.stdout)["error"]
        assert bad not in refused.stdout + refused.stderr
    assert not (tmp_path / "gateway.db").exists()  # refused before anything was written
    dev_key = "devkey-for-my-laptop"  # 20 characters: accepted
    seeded = gateway("seed-dev", LOOPLINE_DEV_API_KEY=dev_key)
    assert seeded.returncode == 0, seeded.stdout + seeded.stderr
    org = json.loads(seeded.stdout)["organization_id"]
    listed = gateway("list-keys", "--org", org)
    assert [key["prefix"] for key in json.loads(listed.stdout)["keys"]] == [
        dev_key[:5]
    ] and dev_key not in listed.stdout
    # a row stored before the rule, whose prefix is the whole (short) key: listed shortened
    with sqlite3.connect(tmp_path / "gateway.db") as database:
        database.execute(
            "UPDATE api_keys SET prefix = ?, key_hash = ?", ("devkey", identity.hash_key("devkey"))
        )
    legacy = gateway("list-keys", "--org", org)
    assert [key["prefix"] for key in json.loads(legacy.stdout)["keys"]] == [
        "d"
    ] and "devkey" not in legacy.stdout


def test_a_key_prefix_is_always_shorter_than_its_key():
    minted = identity.new_key()
    assert identity.key_prefix(minted) == minted[:12]  # unchanged for minted keys
    for length in range(80):
        key = "k" * length
        prefix = identity.key_prefix(key)
        assert (
            key.startswith(prefix)
            and len(prefix) <= length // 4
            and (length == 0 or len(prefix) < length)
        )
