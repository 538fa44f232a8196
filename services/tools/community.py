"""The ModuleX community catalogue: integrations of the pinned `modulex-integrations` package.

The catalogue is generated ahead of time (`make catalogue`, scripts/build_catalogue.py) into
`catalogue_data/`: `index.json` holds every integration's summary and auth options and is read
at start; an integration's actions (`<name>.json`) are read when it is first asked for. The
package itself is never imported here: each call runs in an integration worker
(services/tools/workers), a process of its own under the integrations interpreter, which
applies the outbound policy to every connection the action makes.

A call's arguments are the model's parameters plus the ones the credential fills: the
package's `auth_type` and `auth_data` (its own names: `bearer_token` for Loopline's `bearer`),
and any parameter named like a credential field (`api_key`, `service_key`, ...).
"""

from __future__ import annotations

import json
import logging
import unicodedata
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from services.common.redaction import Redactor
from services.tools import oauth_refresh
from services.tools.catalogue import (
    Action,
    ActionContext,
    ActionError,
    AuthOption,
    Integration,
    LazyActions,
)
from services.tools.config import ToolsSettings
from services.tools.workers.pool import (
    ActionFailed,
    ActionTimeout,
    WorkerCrashed,
    WorkerPool,
    WorkerUnavailable,
)
from services.tools.workers.worker_main import canonical_host

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).parent / "catalogue_data"
SOURCE = "modulex-integrations"
# what an action of the catalogue costs unless LOOPLINE_TOOLS_INTEGRATION_COSTS says otherwise
DEFAULT_MILLICREDITS = 200
# the most one action may cost: what billing records for one tool call (its ledger's
# MAX_TOOL_MILLICREDITS)
MAX_ACTION_MILLICREDITS = 10**12
# how much of an action's own error message the model is shown
ERROR_CHARS = 500
# how many integrations' actions stay loaded (the least recently used are read again)
CACHED_INTEGRATIONS = 32
# credential fields never sent to an action: the package's tools do not use them
_WITHHELD = ("refresh_token", "expires_at", "token_type", "scope")


class Costs:
    """Credit costs of the catalogue's actions in millicredits: `{"integration.action": n,
    "integration": n, "*": n}`, the most specific entry first, else DEFAULT_MILLICREDITS."""

    def __init__(self, raw: str) -> None:
        try:
            table = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"LOOPLINE_TOOLS_INTEGRATION_COSTS is not JSON ({exc.msg})") from None
        if not isinstance(table, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_ACTION_MILLICREDITS
            for v in table.values()
        ):
            raise ValueError(
                "LOOPLINE_TOOLS_INTEGRATION_COSTS must be a JSON object of whole millicredits from "
                f"0 to {MAX_ACTION_MILLICREDITS}"
            )
        self._table: dict[str, int] = table

    def keys(self) -> list[str]:
        """The entries' keys."""
        return list(self._table)

    def of(self, integration: str, action: str) -> int:
        """The cost of `integration.action`."""
        for key in (f"{integration}.{action}", integration, "*"):
            if key in self._table:
                return self._table[key]
        return DEFAULT_MILLICREDITS


def _auth_option(raw: Mapping[str, Any]) -> AuthOption:
    return AuthOption(
        raw["type"],
        raw["label"],
        raw["description"],
        raw["fields"],
        tuple(raw.get("setup_instructions", ())),
        raw.get("oauth"),
    )


def arguments(
    entry: Mapping[str, Any],
    auth: list[Mapping[str, Any]],
    ctx: ActionContext,
    params: dict[str, Any],
) -> dict[str, Any]:
    """The action's arguments: `params` plus what the credential fills (see the module
    docstring). A credential parameter the credential lacks is left to its default, or ""
    when the action requires it (the action then says what is missing)."""
    option = next((o for o in auth if o["type"] == ctx.auth_type), None)
    data = {k: v for k, v in (ctx.secret or {}).items() if k not in _WITHHELD}
    for alias, canonical in (option or {}).get("aliases", {}).items():
        if canonical in data:
            data.setdefault(alias, data[canonical])
    filled = dict(params)
    # a field the credential holds fills the parameter of its name, the model's value or not
    # (e.g. a base_url or region stored with the key: the key goes where its owner said)
    filled.update({k: v for k, v in data.items() if k in entry["parameters"]["properties"]})
    for name, required in entry["credential_parameters"].items():
        if name == "auth_type":
            filled[name] = (option or {}).get("package_type") or ctx.auth_type
        elif name == "auth_data":
            filled[name] = data
        elif name in data:
            filled[name] = data[name]
        elif required:
            filled[name] = ""
    return filled


# what a refusal kind of the workers' policy is called in a tool's error
_REFUSED = {
    "unix": "a Unix socket",
    "host name": "a host name it did not resolve first",
    "non-IP": "a socket that is not TCP/IP",
    "model-chosen host": "a host named in its parameters (with a credential, an action connects "
    "only to its integration's own hosts and the ones its credential holds)",
}


def refusal_text(kinds: tuple[str, ...]) -> str:
    """What the model is told when the outbound policy refused connections of `kinds`."""
    named = [
        _REFUSED.get(k) or f"{'an' if k[0] in 'aeiou' else 'a'} {k} address"
        for k in kinds
        if k != "process"
    ]
    if not named:
        return "the outbound policy of this deployment does not let an action start a process"
    return f"the outbound policy of this deployment refused its connection to {' or '.join(named)}"


def hosts_named(value: Any, found: set[str] | None = None, depth: int = 0) -> set[str]:
    """The hosts in the model's parameters `value`, as a client would connect to them
    (worker_main.canonical_host: IDNA, Unicode dots, IPv4 in any notation): a URL's, a
    `user@host`'s or a `host:port`'s host, and a bare string that is a dotted name or an address
    (checked against the worker's connections when a credential is attached:
    worker_main.Policy.judge_name)."""
    found = set() if found is None else found
    if depth > 64:
        return found
    if isinstance(value, dict):
        for item in value.values():
            hosts_named(item, found, depth + 1)
    elif isinstance(value, list):
        for item in value:
            hosts_named(item, found, depth + 1)
    elif isinstance(value, str) and len(value) <= 2048 and not any(c.isspace() for c in value):
        text = unicodedata.normalize("NFKC", value)
        try:
            host = urlsplit(text if "://" in text else f"//{text}").hostname
        except ValueError:
            host = None
        if host:
            canonical = canonical_host(host)
            if any(c in text for c in ":@") or "." in canonical:
                found.add(canonical)
    return found


def failure_text(integration: str, exc: Exception) -> str:
    """What the model is told about a failed call: built from the failure's kind, type name and
    HTTP status only (an exception's message may quote the credential)."""
    if isinstance(exc, ActionFailed):
        if exc.kind == "refused":
            return refusal_text(exc.refused)
        if exc.kind == "http_status" and exc.status in (401, 403):
            return (
                f"the {integration} API refused the credential (HTTP {exc.status}); ask the user "
                "to connect it again with request_credential"
            )
        if exc.kind == "http_status" and exc.status:
            return f"the {integration} API answered HTTP {exc.status}"
        if exc.kind == "invalid_arguments":
            return "its arguments were not accepted; check them against get_integration_details"
        if exc.kind == "connection":
            return f"could not connect to the {integration} API"
        if exc.kind == "memory":
            return "it ran out of memory and was stopped"
        if exc.kind == "import":
            return "it is not available on this deployment"
        return f"it raised {exc.type_name or 'an error'}"
    if isinstance(exc, WorkerCrashed):
        return "its worker process crashed; the call did not complete"
    return "the integration workers are not available on this deployment"


class CommunityCatalogue:
    """The integrations of `catalogue_data/`, run by `pool` (see the module docstring).

    Args:
        pool: the integration workers.
        costs: credit costs by integration and action.
        data_dir: the generated catalogue (tests point it elsewhere).
    """

    def __init__(self, pool: WorkerPool, costs: Costs, data_dir: Path = DATA_DIR) -> None:
        self.pool = pool
        self.costs = costs
        self.data_dir = data_dir
        index = json.loads((data_dir / "index.json").read_text())
        self.version: str = index["version"]
        self.unavailable: list[dict[str, Any]] = index["unavailable"]
        self._index: list[dict[str, Any]] = index["integrations"]
        self._loaded: OrderedDict[str, dict[str, Action]] = OrderedDict()
        unknown = [key for key in costs.keys() if not self._names(key)]
        if unknown:
            raise ValueError(
                "LOOPLINE_TOOLS_INTEGRATION_COSTS names what the catalogue does not have: "
                + ", ".join(sorted(unknown))
            )

    def _names(self, key: str) -> bool:
        """Whether a costs key ("*", "integration" or "integration.action") names something."""
        if key == "*":
            return True
        name, _, action = key.partition(".")
        raw = next((r for r in self._index if r["name"] == name), None)
        if raw is None or not action:
            return raw is not None
        entries = json.loads((self.data_dir / f"{name}.json").read_text())["actions"]
        return any(entry["name"] == action for entry in entries)

    def oauth_settings(self) -> dict[str, dict[str, Any]]:
        """The OAuth2 settings of the manifests that offer it, by integration name (the operator
        gives the client in LOOPLINE_TOOLS_OAUTH2_INTEGRATIONS: oauth.parse_providers)."""
        return {
            raw["name"]: dict(option["oauth"])
            for raw in self._index
            for option in raw["auth"]
            if option["type"] == "oauth2" and option.get("oauth")
        }

    def integrations(self, taken: set[str]) -> list[Integration]:
        """Every integration whose name is not in `taken` (a built-in of the same name wins)."""
        return [self._integration(raw) for raw in self._index if raw["name"] not in taken]

    def _integration(self, raw: dict[str, Any]) -> Integration:
        return Integration(
            name=raw["name"],
            display_name=raw["display_name"],
            description=raw["description"],
            categories=tuple(raw["categories"]),
            auth_options=tuple(_auth_option(o) for o in raw["auth"]),
            actions=LazyActions(lambda: self._actions(raw)),
            source=SOURCE,
            version=raw["version"],
            logo=raw.get("logo"),
            app_url=raw.get("app_url"),
        )

    def _actions(self, raw: dict[str, Any]) -> dict[str, Action]:
        """The actions of the integration `raw`, from the cache or read from its file."""
        name = raw["name"]
        actions = self._loaded.get(name)
        if actions is None:
            actions = self._loaded[name] = self._read_actions(raw)
            if len(self._loaded) > CACHED_INTEGRATIONS:
                self._loaded.popitem(last=False)
        else:
            self._loaded.move_to_end(name)
        return actions

    def _read_actions(self, raw: dict[str, Any]) -> dict[str, Action]:
        """The actions of the integration `raw`, read from its file."""
        name = raw["name"]
        entries = json.loads((self.data_dir / f"{name}.json").read_text())["actions"]
        return {
            entry["name"]: Action(
                name=entry["name"],
                description=entry["description"],
                parameters=entry["parameters"],
                credit_cost_millicredits=self.costs.of(name, entry["name"]),
                handler=self._handler(raw, entry),
                effects=tuple(entry["effects"]),
            )
            for entry in entries
        }

    def _handler(self, raw: dict[str, Any], entry: dict[str, Any]) -> Any:
        """The handler that runs `entry` in a worker; an oauth2 credential the API refuses
        (HTTP 401) is renewed once and the call made again (oauth_refresh.renew_after_rejection),
        its new tokens redacted from the result as the caller redacts the old ones."""
        name = raw["name"]

        async def handler(ctx: ActionContext, params: dict[str, Any]) -> Any:
            try:
                return await self._call(raw, entry, ctx, params)
            except ActionFailed as exc:
                token = str((ctx.secret or {}).get("access_token") or "")
                if not (exc.kind == "http_status" and exc.status == 401 and token):
                    raise ActionError(failure_text(name, exc)) from exc
                try:
                    renewed = await oauth_refresh.renew_after_rejection(name, token)
                except oauth_refresh.CredentialUnusable as unusable:  # its text is for the model
                    raise ActionError(str(unusable)) from None
                if renewed is None:
                    raise ActionError(failure_text(name, exc)) from exc
            try:
                value = await self._call(raw, entry, replace(ctx, secret=renewed), params)
            except ActionFailed as exc:
                raise ActionError(failure_text(name, exc)) from exc
            return Redactor(renewed).value(value)

        return handler

    async def _call(
        self,
        raw: dict[str, Any],
        entry: dict[str, Any],
        ctx: ActionContext,
        params: dict[str, Any],
    ) -> Any:
        """One call of `entry` in a worker: its result, or ActionFailed (to be told to the model
        or retried), ActionError, TimeoutError."""
        args = arguments(entry, raw["auth"], ctx, params)
        # with a credential, the model may not steer the action to a host of its choice
        model_given = {k: v for k, v in params.items() if args.get(k) is v}
        named = sorted(hosts_named(model_given)) if ctx.secret else []
        try:
            answer = await self.pool.call(
                raw["module"],
                entry["function"],
                args,
                ctx.timeout_s,
                named=named,
                own=raw.get("hosts", []),
            )
        except ActionTimeout as exc:
            raise TimeoutError from exc
        except (WorkerCrashed, WorkerUnavailable) as exc:
            raise ActionError(failure_text(raw["name"], exc)) from exc
        if answer.refused:  # the action may have caught it and answered anyway
            raise ActionError(refusal_text(answer.refused))
        value = answer.value
        # the package's actions catch their own errors and answer {"success": false, "error"}:
        # a failed call (not charged), with the action's own words, redacted by the caller
        if isinstance(value, dict) and value.get("success") is False:
            # redacted before it is cut: a secret cut in two would not be found by the caller
            said = Redactor(ctx.secret).text(str(value.get("error") or "no detail"))[:ERROR_CHARS]
            raise ActionError(f"it answered an error: {said}")
        return value


def from_settings(settings: ToolsSettings) -> CommunityCatalogue | None:
    """The community catalogue `settings` ask for, or None when it is off (no interpreter set)
    or its interpreter is missing (logged: `make venv` creates it)."""
    python = settings.integrations_python()
    if not python:
        return None
    if not Path(python).exists():
        log.warning(
            "community integrations are off: their interpreter is missing",
            extra={"fields": {"python": python}},
        )
        return None
    try:
        hosts = json.loads(settings.tools_integration_hosts or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"LOOPLINE_TOOLS_INTEGRATION_HOSTS is not JSON ({exc.msg})") from None
    if not isinstance(hosts, dict):
        raise ValueError("LOOPLINE_TOOLS_INTEGRATION_HOSTS must be a JSON object")
    pool = WorkerPool(
        python,
        max_workers=settings.tools_integration_workers,
        idle_s=settings.tools_integration_worker_idle_s,
        memory_mb=settings.tools_integration_worker_memory_mb,
        allow_private=settings.tools_allow_private_network,
        hosts=hosts,
    )
    return CommunityCatalogue(pool, Costs(settings.tools_integration_costs))
