"""Generate the integration catalogue from the pinned `modulex-integrations` package.

Run by `make catalogue` with the integrations interpreter (.venv-integrations, Python >= 3.12):
it imports every integration the package declares (the `modulex.tools` entry points) and
writes what the tools service needs to list, describe and call them, so that the service
itself never imports the package (it is loaded only inside the integration workers):

- `<out>/index.json`: the package version, every integration's summary and auth options, and
  the integrations left out with the reason (a dependency that is not installed);
- `<out>/<name>.json`: its actions: JSON Schema parameters (from each tool's `args_schema`,
  without the parameters the credential fills), the function to call, and `effects`.

The rules that turn a manifest into Loopline's terms are here, in one place (docs/integrations.md):
auth types (`bearer_token` is `bearer`, `modulex_key` is no credential), credential field names
(an environment variable's name without its integration prefix, lowercased; an api_key's or a
bearer token's one secret is `api_key` or `token`), and the effects read from action names.
Stdlib and the package only: this runs outside the project's own virtual environment.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

PACKAGE = "modulex-integrations"
GROUP = "modulex.tools"
# the package's auth types -> Loopline's (None: no credential; absent: not offered)
AUTH_TYPES = {
    "api_key": "api_key",
    "bearer_token": "bearer",
    "oauth2": "oauth2",
    "custom": "custom",
    "modulex_key": "none",
}
# the field that holds a single-secret credential, as the package's tools read it
CANONICAL_SECRET = {"api_key": "api_key", "bearer_token": "token", "oauth2": "access_token"}
# action-name words -> the effect they declare; an action whose name has none only reads
# ("update" covers changing state: running a job, cancelling an order, closing an issue)
EFFECT_WORDS = {
    "create": (
        "create",
        "add",
        "insert",
        "upload",
        "new",
        "copy",
        "duplicate",
        "import",
        "save",
        "schedule",
    ),
    "update": (
        "update",
        "edit",
        "modify",
        "set",
        "merge",
        "move",
        "rename",
        "patch",
        "upsert",
        "append",
        "replace",
        "assign",
        "mark",
        "cancel",
        "void",
        "capture",
        "close",
        "reopen",
        "approve",
        "reject",
        "enable",
        "disable",
        "pause",
        "resume",
        "start",
        "stop",
        "restart",
        "run",
        "execute",
        "trigger",
        "deploy",
        "rollback",
        "follow",
    ),
    "send": (
        "send",
        "post",
        "publish",
        "reply",
        "invite",
        "notify",
        "email",
        "sms",
        "call",
        "forward",
        "share",
        "message",
        "tweet",
    ),
    "delete": ("delete", "remove", "archive", "destroy", "purge", "drop", "revoke", "trash"),
}
# a credential's strings go into HTTP headers and URLs: no line break or other control character
NO_CONTROL_CHARACTERS = "^[^\\x00-\\x1f\\x7f]*$"
NO_CREDENTIAL: dict[str, Any] = {
    "type": "none",
    "package_type": "",
    "label": "No credential",
    "description": "A public API: no credential is needed.",
    "setup_instructions": [],
    "fields": None,
    "aliases": {},
}
OAUTH_FIELDS = {
    "type": "object",
    "properties": {
        "access_token": {
            "type": "string",
            "minLength": 1,
            "writeOnly": True,
            "pattern": NO_CONTROL_CHARACTERS,
        },
        "refresh_token": {"type": "string", "writeOnly": True, "pattern": NO_CONTROL_CHARACTERS},
    },
    "required": ["access_token"],
    "additionalProperties": {"type": "string", "pattern": NO_CONTROL_CHARACTERS},
}


def field_name(env_name: str, prefixes: list[str]) -> str:
    """`GITHUB_PERSONAL_TOKEN` -> `personal_token`: the first of `prefixes` it starts with is
    cut, the rest lowercased (the package's tools read `auth_data` by these names)."""
    for prefix in prefixes:
        if env_name.startswith(prefix) and len(env_name) > len(prefix):
            return env_name[len(prefix) :].lower()
    return env_name.lower()


def _common_prefix(names: list[str]) -> str:
    """The underscore-ended prefix every name in `names` (two or more) shares, or ""."""
    if len(names) < 2:
        return ""
    first = names[0]
    end = 0
    for i, char in enumerate(first):
        if any(len(n) <= i or n[i] != char for n in names[1:]):
            break
        if char == "_":
            end = i + 1
    return first[:end]


def auth_option(integration: str, schema: Any) -> dict[str, Any] | None:
    """One auth schema as a Loopline auth option, with `fields` (the credential's JSON Schema)
    and `aliases` (other names the package's tools read a field by), or None if not offered."""
    kind = schema.auth_type
    loopline_type = AUTH_TYPES.get(kind)
    if loopline_type is None:
        return None
    option: dict[str, Any] = {
        "type": loopline_type,
        "package_type": kind,
        "label": schema.display_name,
        "description": schema.description,
        "setup_instructions": list(schema.setup_instructions or []),
        "fields": None,
        "aliases": {},
    }
    if kind == "oauth2":
        config = schema.oauth_config
        option["fields"] = OAUTH_FIELDS
        option["oauth"] = {
            "authorize_url": config.auth_url,
            "token_url": config.token_url,
            "scopes": list(config.scopes),
            "token_endpoint_auth_method": (
                "client_secret_basic"
                if config.token_auth_method == "basic"
                else "client_secret_post"
            ),
            "use_pkce": config.use_pkce,
            "authorize_params": {
                k: v
                for k, v in (("access_type", config.access_type), ("prompt", config.prompt))
                if v
            },
        }
        return option
    if loopline_type == "none":
        return option
    variables = [v for v in schema.setup_environment_variables if not v.only_for_custom]
    names = [v.name for v in variables]
    prefixes = [f"{integration.upper()}_", _common_prefix(names)]
    secrets = [v for v in variables if v.sensitive]
    canonical = CANONICAL_SECRET.get(kind) if len(secrets) == 1 else None
    properties: dict[str, Any] = {}
    required: list[str] = []
    for variable in variables:
        name = field_name(variable.name, [p for p in prefixes if p])
        if canonical and variable is secrets[0]:
            if name != canonical:
                option["aliases"][name] = canonical
            name = canonical
        prop: dict[str, Any] = {
            "type": "string",
            "title": variable.display_name,
            "pattern": NO_CONTROL_CHARACTERS,
        }
        if variable.description:
            prop["description"] = variable.description
        if variable.sensitive:
            prop["writeOnly"] = True
        if variable.required:
            prop["minLength"] = 1
            required.append(name)
        properties[name] = prop
    option["fields"] = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": {"type": "string", "pattern": NO_CONTROL_CHARACTERS},
    }
    return option


# the first words of the actions that only read; an action named otherwise with no word of
# EFFECT_WORDS is taken to change something ("update"): a wrong "changes" costs a question to
# the user, a wrong "only reads" could cost money or data
READ_VERBS = frozenset(
    {
        "get",
        "list",
        "search",
        "retrieve",
        "find",
        "query",
        "read",
        "fetch",
        "describe",
        "check",
        "lookup",
        "view",
        "count",
        "show",
        "browse",
        "inspect",
        "preview",
    }
)


def effects(action: str) -> list[str]:
    """Which of create/update/send/delete the action's name declares by its words; ["update"]
    for a name that neither declares one nor starts with a read verb."""
    words = action.split("_")
    found = [effect for effect, verbs in EFFECT_WORDS.items() if set(words) & set(verbs)]
    return found or ([] if words[0] in READ_VERBS else ["update"])


def credential_keys(options: list[dict[str, Any]]) -> set[str]:
    """Every name the credential of any option can fill a parameter by."""
    keys = {"auth_type", "auth_data"}
    for option in options:
        if option["type"] == "none":
            keys.add("api_key")  # a public API's unused key parameter
        keys |= set((option["fields"] or {}).get("properties", {}))
        keys |= set(option["aliases"])
    return keys


def action_entry(tool: Any, manifest_action: Any, keys: set[str]) -> dict[str, Any]:
    """One action: description, parameters without the credential's, what fills the rest."""
    schema = tool.args_schema.model_json_schema() if tool.args_schema else {"properties": {}}
    props = schema.get("properties", {})
    required = schema.get("required", [])
    filled = [name for name in props if name in keys]
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {k: v for k, v in props.items() if k not in filled},
        "required": [k for k in required if k not in filled],
    }
    if "$defs" in schema:
        parameters["$defs"] = schema["$defs"]
    description = (manifest_action.description if manifest_action else "") or tool.description
    return {
        "name": tool.name,
        "description": description.strip(),
        "parameters": parameters,
        "function": tool.name,
        "credential_parameters": {name: name in required for name in filled},
        "effects": effects(tool.name),
    }


# a URL's host, or a quoted string that is a whole domain name, in an integration's source
_URL_HOST = re.compile(r"https?://([A-Za-z0-9.-]+\.[A-Za-z]{2,})[/:\"'?]")
_FILE_SUFFIXES = (".py", ".json", ".txt", ".md", ".csv", ".png", ".jpg", ".pdf", ".html", ".xml")
_DOMAIN = re.compile(r"[\"']((?:[a-z0-9-]+\.)+[a-z]{2,})[\"']")


def own_hosts(module_name: str) -> list[str]:
    """The hosts an integration's code names (its API's, its regions'), read from its source:
    with a credential, its actions may connect to a host the model named only if it is one of
    these (services/tools/workers/worker_main.py, `Policy.judge_name`)."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        return []
    hosts: set[str] = set()
    for path in sorted(Path(spec.origin).parent.glob("*.py")):
        source = path.read_text()
        hosts |= {h.lower().rstrip(".") for h in _URL_HOST.findall(source)}
        hosts |= {h for h in _DOMAIN.findall(source) if not h.endswith(_FILE_SUFFIXES)}
    return sorted(hosts)


def missing_dependencies(module_name: str) -> list[str]:
    """The distributions the integration's dependencies.toml names that are not installed."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        return []
    path = Path(spec.origin).parent / "dependencies.toml"
    if not path.exists():
        return []
    missing = []
    for requirement in tomllib.loads(path.read_text()).get("dependencies", []):
        name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def build(out: Path) -> dict[str, Any]:
    """Write index.json and one file per integration into `out`; return the index."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.json"):
        stale.unlink()
    integrations, unavailable = [], []
    for entry in sorted(importlib.metadata.entry_points(group=GROUP), key=lambda e: e.name):
        missing = missing_dependencies(entry.value)
        if missing:
            unavailable.append({"name": entry.name, "missing": missing})
            continue
        module = entry.load()
        manifest = module.manifest
        options = [o for o in (auth_option(manifest.name, s) for s in manifest.auth_schemas) if o]
        if any(o["type"] != "none" for o in options):  # a key of ModuleX's own is not ours
            options = [o for o in options if o["type"] != "none"]
        keys = credential_keys(options)
        by_name = {a.name: a for a in manifest.actions}
        actions = [action_entry(t, by_name.get(t.name), keys) for t in module.TOOLS]
        (out / f"{manifest.name}.json").write_text(
            json.dumps({"name": manifest.name, "actions": actions}, indent=1, sort_keys=True) + "\n"
        )
        integrations.append(
            {
                "name": manifest.name,
                "display_name": manifest.display_name,
                "description": manifest.description,
                "categories": list(manifest.categories),
                "version": manifest.version,
                "logo": manifest.logo,
                "app_url": manifest.app_url,
                "module": entry.value,
                "hosts": own_hosts(entry.value),
                "auth": options or [NO_CREDENTIAL],
                "action_count": len(actions),
            }
        )
    index = {
        "package": PACKAGE,
        "version": importlib.metadata.version(PACKAGE),
        "integrations": integrations,
        "unavailable": unavailable,
    }
    (out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return index


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the directory to write")
    args = parser.parse_args()
    index = build(args.out)
    actions = sum(i["action_count"] for i in index["integrations"])
    print(
        f"{PACKAGE} {index['version']}: {len(index['integrations'])} integrations, "
        f"{actions} actions, {len(index['unavailable'])} left out -> {args.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
