"""Schema violation messages (credential auth_data, tool inputs, action parameters): they name the
fields and the rule, never a submitted value, and every name and the whole message are bounded."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from services.common.errors import status_details
from services.common.validation import MAX_MESSAGE_CHARS, MAX_NAME_CHARS, schema_errors

SECRET = "postgresql://admin:Sup3r-S3cret-Pw@db.internal:5432/prod"

SCHEMA = {
    "type": "object",
    "properties": {
        "dsn": {"type": "string", "pattern": "^postgres(ql)?://", "minLength": 12},
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "mode": {"enum": ["read", "write"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2, "uniqueItems": True},
        "kind": {"const": "pg"},
        "name": {"type": "string", "maxLength": 3},
        "either": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    },
    "required": ["dsn"],
    "additionalProperties": False,
}


def _errors(instance, schema=SCHEMA, where="auth_data"):
    return schema_errors(Draft202012Validator(schema), instance, where)


@pytest.mark.parametrize(
    ("instance", "expected"),
    [
        ({"port": 5432}, "auth_data: 'dsn' is required"),
        (
            {"dsn": SECRET, "host": SECRET, "password": SECRET},
            "auth_data: unexpected field(s) 'host', 'password' (allowed: 'dsn', 'port', 'mode', "
            "'tags', 'kind', 'name', 'either')",
        ),
        ({"dsn": 5}, "auth_data.dsn: must be of type string (got integer)"),
        ({"dsn": "mysql://" + SECRET}, 'auth_data.dsn: must match the pattern "^postgres(ql)?://"'),
        ({"dsn": "postgres://"}, "auth_data.dsn: must be at least 12 character(s) long"),
        ({"dsn": "postgres://xy", "port": 0}, "auth_data.port: must be >= 1"),
        (
            {"dsn": "postgres://xy", "mode": SECRET},
            'auth_data.mode: must be one of "read", "write"',
        ),
        (
            {"dsn": "postgres://xy", "tags": [SECRET, SECRET]},
            "auth_data.tags: must not contain duplicate items",
        ),
        (
            {"dsn": "postgres://xy", "tags": ["a", 7]},
            "auth_data.tags[1]: must be of type string (got integer)",
        ),
        ({"dsn": "postgres://xy", "kind": SECRET}, 'auth_data.kind: must be "pg"'),
        (
            {"dsn": "postgres://xy", "name": SECRET},
            "auth_data.name: must be at most 3 character(s) long",
        ),
        (
            {"dsn": "postgres://xy", "either": SECRET},
            "auth_data.either: does not match any of the allowed forms",
        ),
        (SECRET, "auth_data: must be of type object (got string)"),
    ],
)
def test_each_rule_names_the_field_and_the_constraint_never_the_value(instance, expected):
    message = _errors(instance)
    assert message is not None and expected in message, message
    assert (
        "Sup3r-S3cret-Pw" not in message and "db.internal" not in message and "admin" not in message
    )


def test_several_missing_fields_are_named_together_and_valid_input_has_no_message():
    schema = {
        "type": "object",
        "required": ["api_key", "header_name"],
        "dependentRequired": {"user": ["password"]},
    }
    assert _errors({"user": "bob"}, schema) == (
        "auth_data: 'api_key', 'header_name' are required; auth_data: 'password' required when "
        "'user' is given"
    )
    assert _errors({"dsn": "postgres://xy"}) is None


def test_field_names_and_the_message_are_bounded():
    long_name = "n" * 500
    message = _errors({"dsn": "postgres://xy", long_name: SECRET})
    quoted = message.split("unexpected field(s) ")[1].split(" (allowed")[0]
    assert quoted == "'" + "n" * (MAX_NAME_CHARS - 1) + "…'"
    many = _errors(
        {f"field_{i}_" + "x" * 80: SECRET for i in range(200)},
        {"type": "object", "additionalProperties": False},
    )
    assert len(many) <= MAX_MESSAGE_CHARS and "and 190 more" in many
    nested = {"type": "object", "additionalProperties": {"type": "integer"}}
    deep = _errors({f"k{i}": SECRET for i in range(50)}, nested)
    assert len(deep) <= MAX_MESSAGE_CHARS and "and 45 more problems" in deep and "Sup3r" not in deep


def test_control_characters_in_a_field_name_are_escaped():
    message = _errors({"dsn": "postgres://xy", "bad\nname{0}": 1})
    assert "'bad\\nname{0}'" in message and "\n" not in message


async def test_create_credential_names_the_missing_and_unexpected_fields_without_the_secret(
    tools_service,
):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await tools_service.create_credential(
            "postgresql", {"url": SECRET, "password": "Sup3r-S3cret-Pw"}
        )
    details = status_details(caught.value)
    assert (details.code, details.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_AUTH_DATA")
    assert details.message == (
        "auth_data is invalid: auth_data: 'dsn' is required; "
        "auth_data: unexpected field(s) 'password', 'url' (allowed: 'dsn')"
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await tools_service.create_credential("http", {"token": ""}, auth_type="bearer")
    assert (
        status_details(caught.value).message
        == "auth_data is invalid: auth_data.token: must be at least 1 character(s) long"
    )


async def test_tool_and_action_input_errors_name_fields_not_values(tools_service):
    error = await tools_service.failed(
        "execute_integration_tool",
        {
            "integration": "postgresql",
            "action": "run_query",
            "parameters": {"sql": SECRET * 100, "max_rows": SECRET},
        },
    )
    assert "parameters.max_rows: must be of type integer (got string)" in error
    assert "Sup3r-S3cret-Pw" not in error and len(error) < 2 * MAX_MESSAGE_CHARS
    error = await tools_service.failed(
        "search_knowledge", {"query": "q", "top_k": SECRET, "secret_field": SECRET}
    )
    assert "input.top_k: must be of type integer (got string)" in error
    assert "input: unexpected field(s) 'secret_field'" in error
    assert "Sup3r-S3cret-Pw" not in error


# Values from an alphabet no schema text uses, so that finding one in a message means it was echoed.
_VALUES = st.text(alphabet="QZXJ0123456789", min_size=12, max_size=40)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _VALUES,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text("abcdefghijklmnop_", max_size=70), inner, max_size=5)
    ),
    max_leaves=12,
)


def _catalogue_schemas() -> list[Draft202012Validator]:
    from services.tools.catalogue import Catalogue
    from services.tools.tool_definitions import TOOL_DEFINITIONS

    validators = [Draft202012Validator(d["input_schema"]) for d in TOOL_DEFINITIONS]
    for integration in Catalogue.builtin().all():
        validators += [a.validator for a in integration.actions.values()]
        validators += [
            Draft202012Validator(o.fields) for o in integration.auth_options if o.fields is not None
        ]
    return validators + [Draft202012Validator(SCHEMA)]


_SCHEMAS = _catalogue_schemas()


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)


@given(
    instance=_JSON | st.dictionaries(st.text("abcdefghijklmnop_", max_size=70), _JSON, max_size=8),
    index=st.integers(min_value=0, max_value=len(_SCHEMAS) - 1),
)
@settings(max_examples=300, deadline=None)
def test_no_instance_makes_the_builder_raise_exceed_its_bound_or_echo_a_value(instance, index):
    message = schema_errors(_SCHEMAS[index], instance, "parameters")
    if message is None:
        return
    assert len(message) <= MAX_MESSAGE_CHARS
    for value in _strings(instance):
        assert value not in message
