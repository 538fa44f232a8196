"""The deployment kit holds together without a container engine (docs/deployment.md).

Every Kubernetes manifest validates against the Kubernetes schemas (kubernetes-validate ships
them: no network); the compose file holds what it must; every command the Dockerfile, the
compose file, the manifests and the deployment docs give names a real module and sub-command;
every variable they set is a real setting; the lock files pin every dependency pyproject.toml
names, with hashes; and the healthcheck script the compose file uses tells a serving service
from one that is not.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import pytest
import yaml
from kubernetes_validate.utils import latest_version  # type: ignore[import-untyped]
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from pydantic_settings import BaseSettings

from scripts.settings_table import rows
from services.billing.config import BillingSettings
from services.gateway.config import GatewaySettings
from services.orchestrator.config import OrchestratorSettings
from services.tools.config import ToolsSettings
from tests.conftest import start_stack, stop_stack
from tests.gateway.test_rate_limits import _clear_of_the_minute_boundary

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
COMPOSE = DEPLOY / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
SERVICES = ("gateway", "orchestrator", "billing", "tools")
GRPC_SERVICES = ("orchestrator", "billing", "tools")
#: The oldest Kubernetes the manifests are for (native gRPC probes are GA from 1.27), and the
#: newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.27.0", latest_version())
SECRET_TEMPLATE = "secret.example.yaml"
#: The Compose Specification's JSON schema, as the npm package dclint ships it.
COMPOSE_SCHEMA = ROOT / "node_modules" / "dclint" / "schemas" / "compose.schema.json"
#: Settings whose value is a secret (or holds one, as a database URL's password does).
SECRET_SETTINGS = {
    "LOOPLINE_INTERNAL_TOKEN",
    "LOOPLINE_TOOLS_CREDENTIAL_KEY",
    "LOOPLINE_REDIS_URL",
    "LOOPLINE_OPENAI_API_KEY",
    "LOOPLINE_ANTHROPIC_API_KEY",
    *(f"LOOPLINE_{name.upper()}_DATABASE_URL" for name in SERVICES),
}


def _default(settings: type[BaseSettings], field: str) -> Any:
    """A setting's default, read from its class (not from this process's environment)."""
    return settings.model_fields[field].default


GRPC_PORT = {
    "orchestrator": _default(OrchestratorSettings, "orchestrator_port"),
    "billing": _default(BillingSettings, "billing_port"),
    "tools": _default(ToolsSettings, "tools_port"),
}
METRICS_PORT = {
    "orchestrator": _default(OrchestratorSettings, "orchestrator_metrics_port"),
    "billing": _default(BillingSettings, "billing_metrics_port"),
    "tools": _default(ToolsSettings, "tools_metrics_port"),
}
HTTP_PORT = _default(GatewaySettings, "http_port")


# ----- reading the files ------------------------------------------------------------------------


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) of every Kubernetes document in deploy/kubernetes/."""
    found = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found.append((path.name, document))
    return found


def _resources(kind: str) -> dict[str, dict[str, Any]]:
    """The applied documents of `kind` (not the Secret template), by name."""
    return {
        doc["metadata"]["name"]: doc
        for name, doc in _manifests()
        if doc["kind"] == kind and name != SECRET_TEMPLATE
    }


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            instructions.append((word.upper(), rest.strip()))
            pending = ""
    return instructions


def _containers() -> Iterator[tuple[str, dict[str, Any]]]:
    """(workload name, container) of every Deployment and Job."""
    for kind in ("Deployment", "Job"):
        for name, doc in _resources(kind).items():
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield name, container


def _env_names() -> Iterator[tuple[str, str]]:
    """(where, variable) of every variable the kit sets for a Loopline process."""
    for name, container in _containers():
        for item in container.get("env", []):
            yield f"kubernetes {name}", item["name"]
    for name, doc in _resources("ConfigMap").items():
        for key in doc["data"]:
            yield f"ConfigMap {name}", key
    secret = yaml.safe_load((KUBERNETES / SECRET_TEMPLATE).read_text())
    for key in secret["stringData"]:
        yield SECRET_TEMPLATE, key
    for name, service in _compose()["services"].items():
        if "image" in service and service["image"].startswith("${LOOPLINE_IMAGE"):
            for key in service.get("environment", {}):
                yield f"compose {name}", key
    for word, arguments in _dockerfile():
        if word == "ENV":
            for pair in shlex.split(arguments):
                yield "Dockerfile", pair.partition("=")[0]


def _commands() -> Iterator[tuple[str, list[str]]]:
    """(where, argv) of every command the kit runs in the image."""
    for word, arguments in _dockerfile():
        if word == "CMD":
            yield "Dockerfile CMD", json.loads(arguments)
    for name, service in _compose()["services"].items():
        if "command" in service:
            yield f"compose {name}", service["command"]
        test = service.get("healthcheck", {}).get("test", [])
        if test[:1] == ["CMD"] and test[1] == "python":
            yield f"compose {name} healthcheck", test[1:]
    for name, container in _containers():
        yield f"kubernetes {name}", container["command"]


# ----- Kubernetes -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    "name, document",
    [item for item in _manifests() if item[1]["kind"] != "Kustomization"],
    ids=lambda item: (
        item if isinstance(item, str) else item["kind"] + "/" + item["metadata"]["name"]
    ),
)
def test_every_kubernetes_manifest_is_valid(name: str, document: dict[str, Any], version: str):
    kubernetes_validate.validate(document, version, strict=True)


def test_the_schema_check_refuses_a_misspelt_field():
    """So that the validation above is not vacuous: a typo of a probe's name is refused."""
    deployment = _resources("Deployment")["gateway"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, latest_version(), strict=True)


def test_kustomization_applies_every_manifest_but_the_secret_template():
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    manifests = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests - {SECRET_TEMPLATE}


def test_every_resource_is_in_the_loopline_namespace():
    assert list(_resources("Namespace")) == ["loopline"]
    outside = [
        f"{doc['kind']}/{doc['metadata']['name']}"
        for _, doc in _manifests()
        if doc["kind"] not in ("Namespace", "Kustomization")
        and doc["metadata"].get("namespace") != "loopline"
    ]
    assert outside == []


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_runs_two_replicas_unprivileged_on_a_read_only_root(service: str):
    deployment = _resources("Deployment")[service]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", f"services.{service}"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert {"requests", "limits"} <= set(container["resources"])


@pytest.mark.parametrize("service", GRPC_SERVICES)
def test_grpc_services_are_probed_natively_and_headless(service: str):
    container = _resources("Deployment")[service]["spec"]["template"]["spec"]["containers"][0]
    port = GRPC_PORT[service]
    assert container["readinessProbe"]["grpc"] == {"port": port, "service": ""}
    assert container["livenessProbe"]["grpc"] == {"port": port, "service": "liveness"}
    assert {"name": "grpc", "containerPort": port} in container["ports"]
    spec = _resources("Service")[service]["spec"]
    assert spec["clusterIP"] == "None"
    assert [p["port"] for p in spec["ports"]] == [port]
    configmap = _resources("ConfigMap")["loopline-settings"]["data"]
    assert configmap[f"LOOPLINE_{service.upper()}_ADDR"] == f"{service}:{port}"


def test_the_gateway_is_probed_over_http_behind_a_normal_service():
    container = _resources("Deployment")["gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert {"name": "http", "containerPort": HTTP_PORT} in container["ports"]
    spec = _resources("Service")["gateway"]["spec"]
    assert spec.get("clusterIP") != "None"
    assert [(p["port"], p["targetPort"]) for p in spec["ports"]] == [(HTTP_PORT, "http")]


@pytest.mark.parametrize("service", SERVICES)
def test_prometheus_scrapes_each_service_on_its_metrics_port(service: str):
    template = _resources("Deployment")[service]["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    port = HTTP_PORT if service == "gateway" else METRICS_PORT[service]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    ports = [p["containerPort"] for p in template["spec"]["containers"][0]["ports"]]
    assert port in ports


def test_secrets_reach_the_pods_from_the_secret_only():
    literal = [
        (name, item["name"])
        for name, container in _containers()
        for item in container.get("env", [])
        if item["name"] in SECRET_SETTINGS and "secretKeyRef" not in item.get("valueFrom", {})
    ]
    assert literal == []
    configmap = _resources("ConfigMap")["loopline-settings"]["data"]
    assert SECRET_SETTINGS.isdisjoint(configmap)
    assert _resources("Secret") == {}, "the Secret is created apart, never applied from the repo"


def test_the_secret_template_holds_placeholders_only():
    secret = yaml.safe_load((KUBERNETES / SECRET_TEMPLATE).read_text())
    needed = {
        item["valueFrom"]["secretKeyRef"]["key"]
        for _, container in _containers()
        for item in container.get("env", [])
        if "secretKeyRef" in item.get("valueFrom", {})
    }
    values = secret["stringData"]
    assert needed <= set(values)
    for key, value in values.items():
        assert value == "" or "REPLACE_ME" in value or ".example:" in value, key


def test_the_migration_job_migrates_every_service_database():
    (job,) = _resources("Job").values()
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["command"] == ["sh", "/app/deploy/migrate.sh"]
    names = {item["name"] for item in container["env"]}
    assert {f"LOOPLINE_{s.upper()}_DATABASE_URL" for s in SERVICES} <= names
    assert _migrated_services() == list(SERVICES)


def _migrated_services() -> list[str]:
    """The services deploy/migrate.sh migrates when given none."""
    script = (DEPLOY / "migrate.sh").read_text()
    (default,) = re.findall(r'^\[ "\$#" -gt 0 \] \|\| set -- (.+)$', script, re.MULTILINE)
    assert 'python -m "services.$service" migrate' in script
    return default.split()


# ----- compose ----------------------------------------------------------------------------------


@pytest.mark.skipif(not COMPOSE_SCHEMA.exists(), reason="needs the npm package dclint")
def test_the_compose_file_follows_the_compose_specification():
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    errors = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(_compose())]
    assert errors == []


@pytest.mark.parametrize("service", SERVICES)
def test_compose_runs_two_replicas_of_each_service_after_the_migrations(service: str):
    services = _compose()["services"]
    assert {"postgres", "redis", "migrate"} <= set(services)
    assert services["migrate"]["command"] == ["sh", "/app/deploy/migrate.sh"]
    assert services["migrate"]["restart"] == "no"
    spec = services[service]
    assert spec["deploy"]["replicas"] == 2
    assert spec["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert spec["command"] == ["python", "-m", f"services.{service}"]
    assert spec["environment"]["LOOPLINE_AUTO_MIGRATE"] == "false"
    assert spec["environment"]["LOOPLINE_HOST"] == "0.0.0.0"
    assert spec["healthcheck"]["test"][:3] == ["CMD", "python", "/app/deploy/healthcheck.py"]
    if service != "gateway":
        assert spec["healthcheck"]["test"][3:] == ["grpc", str(GRPC_PORT[service])]
        assert spec["environment"][f"LOOPLINE_{service.upper()}_ADDR"] == (
            f"{service}:{GRPC_PORT[service]}"
        )


def test_compose_publishes_the_gateways_through_one_port():
    services = _compose()["services"]
    assert "ports" not in services["gateway"], "two replicas cannot bind one host port"
    gateway = services["gateway"]
    assert gateway["environment"]["LOOPLINE_HTTP_HOST"] == "0.0.0.0"
    assert gateway["healthcheck"]["test"][3:] == ["http", str(HTTP_PORT), "/readyz"]
    edge = services["edge"]
    (published,) = edge["ports"]
    assert published.endswith(":8000")
    assert edge["depends_on"]["gateway"] == {"condition": "service_healthy"}
    mounted = edge["volumes"][0].split(":")[0]
    config = (COMPOSE.parent / mounted).read_text()
    assert re.search(r"^\s*bind :8000$", config, re.MULTILINE)
    assert re.search(rf"^\s*server-template \w+ \d+ gateway:{HTTP_PORT} ", config, re.MULTILINE)
    assert re.search(r"^\s*option httpchk GET /readyz$", config, re.MULTILINE)


@pytest.mark.parametrize("trusted", ["compose", "192.0.2.1"])
async def test_behind_the_edge_proxy_failed_authentications_count_per_client(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, trusted: str
):
    """The compose file's gateways trust X-Forwarded-For (uvicorn's FORWARDED_ALLOW_IPS), which
    its HAProxy sets to each client's address: one client's failures do not block another.
    From a peer not trusted (192.0.2.1 only), the header is ignored: every client is the peer."""
    if trusted == "compose":
        trusted = _compose()["services"]["gateway"]["environment"]["FORWARDED_ALLOW_IPS"]
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", trusted)
    stack = await start_stack(tmp_path, gateway={"failed_auths_per_minute": 2})
    try:
        await _clear_of_the_minute_boundary()
        wrong = {"Authorization": "Bearer mx_live_" + "x" * 43, "X-Organization-ID": stack.org_id}
        async with httpx.AsyncClient(base_url=stack.base_url) as proxy:

            async def status(client: str, headers: dict[str, str]) -> int:
                forwarded = {**headers, "X-Forwarded-For": client}
                return (await proxy.get("/credentials", headers=forwarded)).status_code

            assert [await status("203.0.113.7", wrong) for _ in range(3)] == [401, 401, 429]
            assert await status("203.0.113.7", stack.headers()) == 429
            apart = trusted == "*"
            assert await status("198.51.100.2", stack.headers()) == (200 if apart else 429)
    finally:
        await stop_stack(stack)
    config = (DEPLOY / "haproxy.cfg").read_text()
    assert re.search(r"^\s*http-request del-header X-Forwarded-For$", config, re.MULTILINE)
    assert re.search(r"^\s*option forwardfor$", config, re.MULTILINE)


def test_compose_inlines_no_secret():
    """Secrets are `${VAR:?...}` references (compose refuses to start without them); the
    database URLs take the password the same way; provider keys may default to empty."""
    compose = _compose()
    required = re.compile(r"\$\{(\w+):\?[^}]*\}")
    for name, service in compose["services"].items():
        for key, value in service.get("environment", {}).items():
            if key.endswith("_DATABASE_URL"):
                assert required.search(value) and "POSTGRES_PASSWORD" in value, (name, key)
                password = value.split("://", 1)[1].split("@")[0].partition(":")[2]
                assert required.fullmatch(password), (name, key, "password inlined")
            elif key in ("LOOPLINE_INTERNAL_TOKEN", "LOOPLINE_TOOLS_CREDENTIAL_KEY"):
                assert required.fullmatch(value) and key in value, (name, key)
            elif key.endswith(("_API_KEY", "_PASSWORD", "_TOKEN")):
                assert re.fullmatch(rf"\$\{{{key}(:-|:\?)[^}}]*\}}", value), (name, key)
    assert compose["services"]["tools"]["environment"]["LOOPLINE_TOOLS_CREDENTIAL_KEY"]
    example = (DEPLOY / "compose.env.example").read_text()
    assigned = dict(re.findall(r"^(\w+)=(.*)$", example, re.MULTILINE))
    assert {"POSTGRES_PASSWORD", "LOOPLINE_INTERNAL_TOKEN", "LOOPLINE_TOOLS_CREDENTIAL_KEY"} <= (
        {k for k, v in assigned.items() if v == ""}
    ), "the example leaves the secrets empty, so compose refuses it until they are set"


# ----- the image and its commands ---------------------------------------------------------------


def test_every_variable_the_kit_sets_is_a_setting():
    settings = {variable for variable, *_ in rows()}
    runtime = {"PATH", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED"}
    unknown = [
        (where, name)
        for where, name in _env_names()
        if name not in settings
        and not name.startswith("OTEL_")
        and name != "FORWARDED_ALLOW_IPS"  # uvicorn's: whose X-Forwarded-For the gateway trusts
        and not (where == "Dockerfile" and (name in runtime or name.startswith("PIP_")))
    ]
    assert unknown == []


def _subcommands(module: str) -> set[str]:
    """The sub-commands `python -m module --help` lists (argparse's {a,b,...})."""
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (choices,) = re.findall(r"\{([a-z,-]+)\}", result.stdout)[:1]
    return set(choices.split(","))


def test_every_command_names_a_real_module_and_sub_command():
    calls: dict[str, set[str]] = {}
    scripts = set()
    for where, argv in _commands():
        if argv[:2] == ["python", "-m"]:
            calls.setdefault(argv[2], set()).update(argv[3:4] or ["serve"])
        else:
            assert argv[0] in ("python", "sh"), where
            scripts.add(argv[1])
    for service in _migrated_services():
        calls.setdefault(f"services.{service}", set()).add("migrate")
    docs = [DEPLOY / "compose.env.example", KUBERNETES / SECRET_TEMPLATE]
    docs += [ROOT / "docs" / "deployment.md"]
    for page in docs:
        for module, sub in re.findall(
            r"python -m (services\.\w+)(?: ([a-z][a-z-]*))?", page.read_text()
        ):
            calls.setdefault(module, set()).add(sub or "serve")
    assert set(calls) == {f"services.{s}" for s in SERVICES}
    for module, used in sorted(calls.items()):
        assert used <= _subcommands(module), module
    copied = " ".join(args for word, args in _dockerfile() if word == "COPY")
    for script in scripts:
        relative = script.removeprefix("/app/")
        assert (ROOT / relative).is_file() and relative in copied, script


def test_the_image_is_built_from_the_lock_and_runs_unprivileged():
    instructions = _dockerfile()
    stages = [args for word, args in instructions if word == "FROM"]
    assert len(stages) == 2 and stages[0].endswith("AS builder"), "multi-stage"
    assert "ARG PYTHON_IMAGE=python:3.12-slim" in [f"{w} {a}" for w, a in instructions]
    runs = [args for word, args in instructions if word == "RUN"]
    for lock in ("requirements.lock", "requirements-integrations.lock"):
        assert any("--require-hashes" in run and f"-r /tmp/{lock}" in run for run in runs), lock
    (user,) = [args for word, args in instructions if word == "USER"]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) != 0
    security = _resources("Deployment")["gateway"]["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsUser"] == int(user.split(":")[0])
    # what COPY takes from the build context exists, and .dockerignore lets it in
    allowed = [line[1:].rstrip("/") for line in _dockerignore() if line.startswith("!")]
    for word, args in instructions:
        if word == "COPY" and "--from=" not in args:
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), source
                assert any(source == a or source.startswith(a + "/") for a in allowed), source


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


# ----- the lock files ---------------------------------------------------------------------------


def _lock(name: str) -> dict[str, list[tuple[Version, int]]]:
    """Package -> [(version pinned, number of hashes)], one per marker fork."""
    pins: dict[str, list[tuple[Version, int]]] = {}
    current = None
    for line in (ROOT / name).read_text().splitlines():
        found = re.match(r"^([A-Za-z0-9._-]+)==([^\s;\\]+)", line)
        if found:
            current = canonicalize_name(found.group(1))
            pins.setdefault(current, []).append((Version(found.group(2)), 0))
        elif line.strip().startswith("--hash=sha256:") and current:
            version, hashes = pins[current][-1]
            pins[current][-1] = (version, hashes + 1)
        elif line and not line.startswith(" "):
            assert line.startswith("#"), f"{name}: unexpected line {line!r}"
    return pins


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize(
    "lock, groups",
    [("requirements.lock", ["runtime"]), ("requirements-dev.lock", ["runtime", "dev"])],
)
def test_the_lock_pins_every_dependency_of_pyproject_with_hashes(lock: str, groups: list[str]):
    project = _pyproject()
    wanted = {
        "runtime": project["dependencies"],
        "dev": project["optional-dependencies"]["dev"],
    }
    pins = _lock(lock)
    for group in groups:
        for text in wanted[group]:
            requirement = Requirement(text)
            name = canonicalize_name(requirement.name)
            assert name in pins, f"{lock} lacks {name}: run `make lock`"
            for version, _ in pins[name]:
                assert requirement.specifier.contains(version, prereleases=True), (
                    f"{lock} pins {name}=={version}, pyproject.toml wants {requirement}: "
                    "run `make lock`"
                )
    unhashed = [name for name, forks in pins.items() if any(n == 0 for _, n in forks)]
    assert unhashed == []


def test_the_image_and_the_development_venv_get_the_same_versions():
    runtime, dev = _lock("requirements.lock"), _lock("requirements-dev.lock")
    assert set(runtime) <= set(dev)
    differ = {
        name: (forks, dev[name])
        for name, forks in runtime.items()
        if {v for v, _ in forks} != {v for v, _ in dev[name]}
    }
    assert differ == {}


def test_make_lock_uses_the_uv_that_pyproject_pins():
    (pin,) = [d for d in _pyproject()["optional-dependencies"]["dev"] if d.startswith("uv==")]
    dry = subprocess.run(
        ["make", "-n", "lock"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0, dry.stderr
    assert f'"{pin}"' in dry.stdout
    assert "--generate-hashes" in dry.stdout and "-o requirements-dev.lock" in dry.stdout


# ----- the healthcheck script -------------------------------------------------------------------


async def _healthcheck(*args: str | int) -> tuple[int, str]:
    """Run deploy/healthcheck.py without blocking the loop the services run on."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(DEPLOY / "healthcheck.py"),
        *map(str, args),
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
    return process.returncode or 0, stderr.decode()


async def test_the_healthcheck_script_tells_serving_from_not(services, unused_tcp_port: int):
    assert await _healthcheck("grpc", services.orchestrator.port) == (0, "")
    assert await _healthcheck("grpc", services.billing.port, "") == (0, "")
    assert await _healthcheck("grpc", services.tools.port, "liveness") == (0, "")
    assert await _healthcheck("http", services.gateway.port, "/readyz") == (0, "")
    code, why = await _healthcheck("grpc", services.tools.port, "no.such.Service")
    assert code == 1 and "NOT_FOUND" in why
    code, why = await _healthcheck("http", services.gateway.port, "/no-such-path")
    assert code == 1 and "404" in why
    code, why = await _healthcheck("grpc", unused_tcp_port)
    assert code == 1 and "UNAVAILABLE" in why
    code, _ = await _healthcheck("http", unused_tcp_port, "/healthz")
    assert code == 1
