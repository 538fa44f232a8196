"""API keys can be revoked (fresh-eyes test: there was no way to, short of editing the database)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from services.gateway import identity
from services.gateway.identity import Authenticator, AuthError


async def test_a_revoked_key_is_refused(stack):
    member = await stack.member("admin")
    auth = Authenticator(stack.gateway.sessions, ttl_s=30.0)
    header = f"Bearer {member['api_key']}"
    assert (await auth.authenticate(header, stack.org_id)).user_id == member["user_id"]
    revoked = await identity.revoke_key(stack.gateway.sessions, key_id=member["key_id"])
    assert revoked["key_id"] == member["key_id"] and revoked["user_id"] == member["user_id"]
    again = await identity.revoke_key(stack.gateway.sessions, key=member["api_key"])  # by the key itself: same, idempotent
    assert again == revoked
    fresh = Authenticator(stack.gateway.sessions, ttl_s=30.0)  # a gateway whose cache has expired
    try:
        await fresh.authenticate(header, stack.org_id)
    except AuthError as error:
        assert error.status == 401
    else:
        raise AssertionError("a revoked key was accepted")
    assert await identity.revoke_key(stack.gateway.sessions, key_id="key_nope") is None


def test_revoke_key_command(tmp_path):
    env = {**os.environ, "LOOPLINE_DATA_DIR": str(tmp_path)}

    def gateway(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.gateway", *args], env=env, input=stdin, capture_output=True, text=True, check=False)

    org = json.loads(gateway("seed-dev").stdout)["organization_id"]
    member = json.loads(gateway("add-member", "--org", org, "--role", "member").stdout)
    listed = gateway("list-keys", "--org", org)
    keys = {key["key_id"]: key for key in json.loads(listed.stdout)["keys"]}
    assert keys[member["key_id"]]["prefix"] == member["api_key"][:12] and keys[member["key_id"]]["revoked_at"] is None
    assert keys[member["key_id"]]["role"] == "member" and len(keys) == 2  # the dev owner's key and this one
    assert member["api_key"] not in listed.stdout
    by_id = gateway("revoke-key", "--key-id", member["key_id"])
    assert by_id.returncode == 0 and json.loads(by_id.stdout)["key_id"] == member["key_id"]
    by_key = gateway("revoke-key", stdin=member["api_key"] + "\n")
    assert json.loads(by_key.stdout) == json.loads(by_id.stdout)
    assert member["api_key"] not in by_key.stdout + by_key.stderr
    unknown = gateway("revoke-key", "--key-id", "key_nope")
    assert unknown.returncode == 1 and json.loads(unknown.stdout) == {"error": "no such API key"}
    after = {key["key_id"]: key for key in json.loads(gateway("list-keys", "--org", org).stdout)["keys"]}
    assert after[member["key_id"]]["revoked_at"] == json.loads(by_id.stdout)["revoked_at"]
    missing = gateway("list-keys", "--org", "org_nope")
    assert missing.returncode == 1 and json.loads(missing.stdout) == {"error": "no organization 'org_nope'"}


def test_add_member_refuses_an_unusable_organization_id(tmp_path):
    # second fresh-eyes test: "" and a 20,000-character id each created an organization
    env = {**os.environ, "LOOPLINE_DATA_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-m", "services.gateway", "seed-dev"], env=env, capture_output=True, text=True, check=True)
    for org in ("", "x" * 129, "two words"):
        result = subprocess.run([sys.executable, "-m", "services.gateway", "add-member", "--org", org, "--role", "owner"],
                                env=env, capture_output=True, text=True, check=False)
        assert result.returncode == 2 and "organization id" in result.stderr
