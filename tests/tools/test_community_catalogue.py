"""The generated community catalogue (services/tools/catalogue_data): it is what the generator
makes from the pinned package today, every schema in it is valid, the credential never shows in
a model-facing schema, and a call's arguments are filled from the credential the package's way.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from services.common.runner import CannotStart
from services.tools.catalogue import EFFECTS, ActionContext, ActionError, Catalogue
from services.tools.community import (
    CACHED_INTEGRATIONS,
    DATA_DIR,
    CommunityCatalogue,
    Costs,
    arguments,
    hosts_named,
)
from services.tools.config import ToolsSettings
from services.tools.server import ToolsServer
from services.tools.workers.pool import CallResult

ROOT = Path(__file__).resolve().parents[2]
INDEX = json.loads((DATA_DIR / "index.json").read_text())
PYTHON = ToolsSettings().integrations_python()
needs_interpreter = pytest.mark.skipif(
    not Path(PYTHON).exists(),
    reason="no .venv-integrations: `make venv` creates it (Python >= 3.12)",
)


def actions_of(name: str) -> list[dict]:
    return json.loads((DATA_DIR / f"{name}.json").read_text())["actions"]


@needs_interpreter
def test_committed_catalogue_is_what_the_generator_makes_from_the_pinned_package(tmp_path):
    subprocess.run(
        [PYTHON, str(ROOT / "scripts/build_catalogue.py"), str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    made = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    committed = {p.name: p.read_text() for p in DATA_DIR.glob("*.json")}
    assert sorted(made) == sorted(committed), "run `make catalogue` and commit the result"
    changed = [name for name in made if made[name] != committed[name]]
    assert not changed, f"run `make catalogue`: {changed[:5]} differ"


@needs_interpreter
def test_every_integration_of_the_package_is_in_the_catalogue_or_left_out_with_a_reason():
    script = (
        "import importlib.metadata as m, json;"
        "print(json.dumps(sorted(e.name for e in m.entry_points(group='modulex.tools'))))"
    )
    out = subprocess.run([PYTHON, "-c", script], check=True, capture_output=True, text=True).stdout
    declared = set(json.loads(out))
    listed = {i["name"] for i in INDEX["integrations"]}
    left_out = {u["name"] for u in INDEX["unavailable"]}
    assert declared == listed | left_out
    assert all(u["missing"] for u in INDEX["unavailable"])
    assert len(listed) > 180


def test_every_schema_in_the_catalogue_is_valid_json_schema_2020_12():
    count = 0
    for integration in INDEX["integrations"]:
        for option in integration["auth"]:
            if option["fields"] is not None:
                Draft202012Validator.check_schema(option["fields"])
        for action in actions_of(integration["name"]):
            Draft202012Validator.check_schema(action["parameters"])
            assert set(action["effects"]) <= set(EFFECTS)
            count += 1
    assert count == sum(i["action_count"] for i in INDEX["integrations"]) > 2000


def test_no_model_facing_schema_asks_for_the_credential():
    for integration in INDEX["integrations"]:
        fields: set[str] = {"auth_type", "auth_data"}
        for option in integration["auth"]:
            fields |= set((option["fields"] or {}).get("properties", {})) | set(option["aliases"])
        for action in actions_of(integration["name"]):
            shown = set(action["parameters"]["properties"])
            assert not shown & fields, (integration["name"], action["name"], shown & fields)
            assert not set(action["parameters"]["required"]) - shown


def test_auth_types_are_loopline_s_and_secrets_are_write_only():
    github = next(i for i in INDEX["integrations"] if i["name"] == "github")
    types = {o["type"]: o for o in github["auth"]}
    assert set(types) == {"oauth2", "bearer"}
    assert types["bearer"]["package_type"] == "bearer_token"
    assert types["bearer"]["fields"]["properties"]["token"]["writeOnly"] is True
    assert types["bearer"]["fields"]["required"] == ["token"]
    assert types["oauth2"]["oauth"]["token_url"] == "https://github.com/login/oauth/access_token"
    qdrant = next(i for i in INDEX["integrations"] if i["name"] == "qdrant")
    assert [o["type"] for o in qdrant["auth"]] == ["custom"]
    assert set(qdrant["auth"][0]["fields"]["properties"]) == {"base_url", "api_key"}
    arxiv = next(i for i in INDEX["integrations"] if i["name"] == "arxiv")
    assert [o["type"] for o in arxiv["auth"]] == ["none"]


def test_actions_that_create_send_or_delete_say_so():
    effects = {a["name"]: a["effects"] for a in actions_of("github")}
    assert effects["create_issue"] == ["create"]
    assert effects["delete_repository"] == ["delete"]
    assert effects["merge_pull_request"] == ["update"]
    assert effects["list_repositories"] == effects["get_file_content"] == []
    assert "send" in {a["name"]: a["effects"] for a in actions_of("slack")}["post_message"]


def test_a_built_in_wins_over_a_catalogue_integration_of_the_same_name():
    community = CommunityCatalogue(pool=None, costs=Costs(""))  # type: ignore[arg-type]
    builtin = {i.name for i in Catalogue.builtin().all()}
    names = [i.name for i in community.integrations(taken=builtin | {"github"})]
    assert "github" not in names and "slack" in names
    assert not builtin & set(names)


def context(auth_type: str, secret: dict | None) -> ActionContext:
    return ActionContext(secret, auth_type, 5.0, 1024, False)


def test_a_bearer_credential_is_passed_as_the_package_s_auth_type_and_auth_data():
    github = next(i for i in INDEX["integrations"] if i["name"] == "github")
    entry = next(a for a in actions_of("github") if a["name"] == "get_repository")
    secret = {"token": "ghp_x", "refresh_token": "never-sent"}
    args = arguments(entry, github["auth"], context("bearer", secret), {"owner": "o", "repo": "r"})
    assert args["auth_type"] == "bearer_token"
    assert args["auth_data"]["token"] == "ghp_x"
    assert "refresh_token" not in args["auth_data"]
    assert args["owner"] == "o"


def test_an_api_key_credential_fills_the_api_key_parameter():
    airtable = next(i for i in INDEX["integrations"] if i["name"] == "airtable")
    entry = next(a for a in actions_of("airtable") if a["name"] == "list_bases")
    args = arguments(entry, airtable["auth"], context("api_key", {"api_key": "pat"}), {})
    assert args == {"api_key": "pat"}


def test_named_credential_fields_fill_parameters_of_the_same_name():
    supabase = next(i for i in INDEX["integrations"] if i["name"] == "supabase")
    entry = next(a for a in actions_of("supabase") if a["name"] == "select_row")
    assert {"subdomain", "service_key"} <= set(entry["credential_parameters"])
    secret = {"api_key": "svc", "subdomain": "proj"}
    args = arguments(entry, supabase["auth"], context("api_key", secret), {"table": "t"})
    assert args["service_key"] == "svc" and args["subdomain"] == "proj"


def test_costs_take_the_most_specific_entry():
    costs = Costs('{"github.delete_repository": 900, "github": 300, "*": 50}')
    assert costs.of("github", "delete_repository") == 900
    assert costs.of("github", "get_issue") == 300
    assert costs.of("slack", "send_message") == 50
    assert Costs("").of("slack", "send_message") == 200
    with pytest.raises(ValueError):
        Costs('{"github": -1}')


def test_the_catalogue_is_of_the_version_the_lock_pins_with_hashes():
    lock = (ROOT / "requirements-integrations.lock").read_text()
    pinned = dict(re_pins(lock))
    assert pinned["modulex-integrations"] == INDEX["version"]
    wanted = (ROOT / "requirements-integrations.in").read_text().split("\n")
    for line in wanted:
        name = line.split("==")[0].strip()
        if name and not name.startswith("#"):
            assert name in pinned, name
    assert lock.count("--hash=sha256:") >= len(pinned)


def re_pins(lock: str) -> list[tuple[str, str]]:
    """(name, version) of every `name==version` pin in a lock file."""
    return re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", lock, re.MULTILINE)


def test_only_the_most_recently_used_integrations_keep_their_actions_loaded():
    community = CommunityCatalogue(pool=None, costs=Costs(""))  # type: ignore[arg-type]
    integrations = community.integrations(taken=set())
    for integration in integrations:
        assert len(integration.actions) > 0
    assert len(community._loaded) == CACHED_INTEGRATIONS  # noqa: SLF001 - the cache's bound
    first = integrations[0]
    assert first.name not in community._loaded  # noqa: SLF001
    assert first.actions[next(iter(first.actions))].name  # read again from its file
    assert first.name in community._loaded  # noqa: SLF001


GITHUB_APP = '{"name": "github", "client_id": "c", "client_secret": "s"}'
OAUTH_HTTP = json.dumps(
    [
        {
            "name": "http",
            "authorize_url": "https://a.example/authorize",
            "token_url": "https://a.example/token",
            "client_id": "c",
            "api_base_url": "https://a.example/api",
        }
    ]
)
STDIO_GITHUB = '[{"name": "github", "command": "/bin/true"}]'


@pytest.mark.parametrize(
    ("setting", "value", "says"),
    [
        ("tools_integration_costs", '{"github": -5}', "whole millicredits"),
        ("tools_integration_costs", '{"github": 10000000000000}', "from 0 to 1000000000000"),
        ("tools_integration_costs", '{"gitrub": 100}', "does not have: gitrub"),
        ("tools_integration_costs", '{"github.no_such": 1}', "does not have: github.no_such"),
        ("tools_integration_costs", "x", "INTEGRATION_COSTS is not JSON"),
        ("tools_integration_hosts", '{"api.github.com": "notanaddr"}', "not an IP address"),
        ("tools_oauth2_integrations", '[{"name": "acme"}]', "lacks authorize_url"),
        ("tools_oauth2_integrations", OAUTH_HTTP, "http is the name of a built-in"),
        ("tools_oauth2_integrations", f"[{GITHUB_APP}, {GITHUB_APP}]", "github more than once"),
        ("tools_mcp_stdio_servers", STDIO_GITHUB, "github is the name of another integration"),
    ],
)
async def test_a_malformed_setting_stops_the_start_with_one_line(tmp_path, setting, value, says):
    settings = ToolsSettings(
        data_dir=tmp_path, tools_port=0, tools_metrics_port=0, **{setting: value}
    )
    with pytest.raises(CannotStart, match=says):
        await ToolsServer.start(settings)


def test_no_credential_field_takes_a_control_character():
    for integration in INDEX["integrations"]:
        for option in integration["auth"]:
            if option["fields"] is None:
                continue
            validator = Draft202012Validator(option["fields"])
            good = {name: "x" for name in option["fields"]["required"]}
            assert validator.is_valid(good), (integration["name"], option["type"])
            for name in [*option["fields"]["required"], "extra"]:
                assert not validator.is_valid({**good, name: "a\r\nInjected: 1"}), name


def test_the_hosts_the_model_names_are_read_as_a_client_connects_to_them():
    named = hosts_named(
        {
            "region": "evil\u3002test",  # an ideographic full stop
            "nested": [{"base_url": "https://\u0435vil.test:443/x"}],  # a Cyrillic е
            "decimal": "http://2130706433:8080",
            "hex": "http://0x7f000001/",
            "mapped": "http://[::ffff:127.0.0.1]:1",
            "userinfo": "x@localhost:28444",
            "fullwidth": "https://evil\uff0etest\uff1a443",
            "word": "octo",  # a bare word is not a host
        }
    )
    assert named == {"evil.test", "xn--vil-qdd.test", "127.0.0.1", "localhost"}


async def test_an_error_an_action_answers_is_redacted_before_it_is_cut():
    secret = "OBS-NU2-SECRET-ccc"

    class Pool:
        async def call(self, *args: object, **kwargs: object) -> CallResult:
            return CallResult({"success": False, "error": "P" * 490 + secret}, (), 1.0)

    community = CommunityCatalogue(pool=Pool(), costs=Costs(""))  # type: ignore[arg-type]
    obsidian = next(i for i in community.integrations(taken=set()) if i.name == "obsidian")
    action = next(iter(obsidian.actions.values()))
    context = ActionContext({"api_key": secret}, "api_key", 5.0, 1024, False)
    with pytest.raises(ActionError) as failed:
        await action.handler(context, {})
    assert secret[:6] not in str(failed.value)
