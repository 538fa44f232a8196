"""Human-in-the-loop tools: their schemas, the questions they ask, and answer validation.

The question and answer shapes are the official SDK's `UserInputRequest` and
`UserInputResponse` unions (`modulex/types/realtime.py`); the spec's "Human-in-the-loop
pause" section defines the pause itself.
"""

from __future__ import annotations

import json
from typing import Any

from services.common import pb

_OPTION = {
    "type": "object",
    "properties": {
        "value": {"type": "string", "description": "Machine value returned when chosen."},
        "label": {"type": "string", "description": "Text shown to the user."},
        "description": {"type": "string", "description": "Optional longer explanation."},
    },
    "required": ["value", "label"],
    "additionalProperties": False,
}

TOOL_KINDS = {
    "ask_user_choice": "single_choice",
    "ask_user_multi_choice": "multi_choice",
    "ask_user_yes_no": "yes_no",
    "ask_user_free_text": "free_text",
    "request_credential": "credential_request",
}

TOOL_DEFINITIONS: list[dict[str, Any]] = [
    {
        "name": "ask_user_choice",
        "description": (
            "Ask the user to pick exactly one of several options. The run pauses until they answer."
        ),
        "input_schema": {
            "type": "object",
            "properties": {
                "message": {"type": "string", "description": "The question."},
                "options": {"type": "array", "items": _OPTION, "minItems": 2},
                "allow_free_text": {
                    "type": "boolean",
                    "description": "Whether the user may answer in their own words.",
                },
            },
            "required": ["message", "options"],
            "additionalProperties": False,
        },
    },
    {
        "name": "ask_user_multi_choice",
        "description": "Ask the user to pick several options. The run pauses until they answer.",
        "input_schema": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "options": {"type": "array", "items": _OPTION, "minItems": 1},
                "min_selections": {"type": "integer", "minimum": 0},
                "max_selections": {"type": "integer", "minimum": 1},
            },
            "required": ["message", "options"],
            "additionalProperties": False,
        },
    },
    {
        "name": "ask_user_yes_no",
        "description": (
            "Ask the user a yes/no question, e.g. to confirm an action. "
            "The run pauses until they answer."
        ),
        "input_schema": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "yes_label": {"type": "string"},
                "no_label": {"type": "string"},
            },
            "required": ["message"],
            "additionalProperties": False,
        },
    },
    {
        "name": "ask_user_free_text",
        "description": "Ask the user for free text. The run pauses until they answer.",
        "input_schema": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "placeholder": {"type": "string"},
                "multiline": {"type": "boolean"},
                "min_length": {"type": "integer", "minimum": 0},
                "max_length": {"type": "integer", "minimum": 1},
            },
            "required": ["message"],
            "additionalProperties": False,
        },
    },
    {
        "name": "request_credential",
        "description": (
            "Ask the user to connect a credential for an integration that has none. "
            "The run pauses until they do."
        ),
        "input_schema": {
            "type": "object",
            "properties": {
                "integration": {
                    "type": "string",
                    "description": "The integration's name, e.g. 'postgresql'.",
                },
                "message": {"type": "string", "description": "Why the credential is needed."},
            },
            "required": ["integration", "message"],
            "additionalProperties": False,
        },
    },
]


_validators: dict[
    str, Any
] = {}  # tool name -> compiled input schema (jsonschema is imported at the first question)


def input_problems(tool: str, tool_input: Any) -> str | None:
    """What is wrong with a question tool's input against its `input_schema` (TOOL_DEFINITIONS),
    or None: missing or unexpected fields, wrong types, too few options, bounds
    (`services.common.validation.schema_errors`: it names fields and rules, never a value).

    Unknown fields are refused, as the tools service's five tools refuse them: a model that
    misspells `allow_free_text` learns it from the error instead of asking a different question.
    """
    # imported here, not at start-up: most runs ask nothing (idle memory)
    from jsonschema import Draft202012Validator

    from services.common.validation import schema_errors

    validator = _validators.get(tool)
    if validator is None:
        schema = next(d["input_schema"] for d in TOOL_DEFINITIONS if d["name"] == tool)
        validator = _validators[tool] = Draft202012Validator(schema)
    problems = schema_errors(validator, tool_input, "input")
    if problems is None and pb.holds_nul(tool_input):
        # an answer cannot carry one (the gateway refuses U+0000 in a request body), so an option
        # holding one could never be picked
        return "input: text must not contain U+0000 (NUL)"
    return problems


class InvalidAnswer(ValueError):
    """An answer that does not fit its question (becomes HTTP 400; the question stays pending)."""


def _options(raw: Any) -> list[dict[str, Any]]:
    options = []
    for item in raw:  # each {value, label[, description]}: checked by input_problems
        option = {"value": item["value"], "label": item["label"] or item["value"]}
        if item.get("description"):
            option["description"] = item["description"]
        options.append(option)
    return options


def _count(tool_input: dict[str, Any], name: str) -> int | None:
    """A whole-number field of a question tool's input (None when absent); ValueError otherwise
    (the model sees the message as its tool error, so it names the field, not Python)."""
    value = tool_input.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value != int(value)
        or value < 0
    ):
        raise ValueError(f"'{name}' must be a whole number of at least 0")
    return int(value)


def build_request(
    tool: str,
    tool_input: dict[str, Any],
    request_id: str,
    integration: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `UserInputRequest` dict that `tool` called with `tool_input` asks.

    `integration` (for request_credential) is {name, display_name, auth_options:[...]}.
    Raises ValueError when the input cannot make a question: it breaks the tool's input
    schema (`input_problems`: a missing or unexpected field, a wrong type, fewer options
    than the schema's minimum), or its parts do not fit together (an empty message,
    duplicate option values, selection or length bounds that contradict each other).
    """
    problems = input_problems(tool, tool_input)
    if problems:
        raise ValueError(problems)
    kind = TOOL_KINDS[tool]
    message = tool_input["message"].strip()
    if not message:
        raise ValueError("a question needs a non-empty 'message'")
    request: dict[str, Any] = {
        "kind": kind,
        "request_id": request_id,
        "message": message,
        "required": True,
    }
    if kind in ("single_choice", "multi_choice"):
        options = _options(tool_input.get("options"))
        if not options:
            raise ValueError("a choice question needs 'options' with 'value' and 'label'")
        if len({o["value"] for o in options}) != len(options):
            raise ValueError("option values must be unique")
        request["options"] = options
        if kind == "single_choice":
            request["allow_free_text"] = bool(tool_input.get("allow_free_text", False))
        else:
            low = _count(tool_input, "min_selections") or 0
            high = _count(tool_input, "max_selections")
            high = min(high, len(options)) if high is not None else None
            if low > len(options) or (high is not None and high < max(low, 1)):
                raise ValueError("min_selections/max_selections do not fit the options")
            request["min_selections"] = low
            request["max_selections"] = high
    elif kind == "yes_no":
        request["yes_label"] = str(tool_input.get("yes_label") or "Yes")
        request["no_label"] = str(tool_input.get("no_label") or "No")
    elif kind == "free_text":
        request["placeholder"] = tool_input.get("placeholder")
        request["multiline"] = bool(tool_input.get("multiline", False))
        request["min_length"] = _count(tool_input, "min_length") or 0
        request["max_length"] = _count(tool_input, "max_length")
        if request["max_length"] is not None and request["max_length"] < request["min_length"]:
            raise ValueError("max_length is below min_length")
    else:
        name = tool_input["integration"].strip()
        if not name:
            raise ValueError("request_credential needs 'integration'")
        info = integration or {}
        request["integration_name"] = name
        request["integration_display_name"] = str(info.get("display_name") or name)
        request["auth_options"] = info.get("auth_options") or [
            {"auth_type": "api_key", "display_name": "API key"}
        ]
    return request


# The fields of each answer kind: the official SDK's UserInputResponse union (modulex-python
# 1.0.0, types/realtime.py); anything else in an answer is refused (README: unknown fields are 400).
ANSWER_FIELDS: dict[str, frozenset[str]] = {
    "single_choice": frozenset({"kind", "selected_value", "free_text"}),
    "multi_choice": frozenset({"kind", "selected_values"}),
    "yes_no": frozenset({"kind", "answer"}),
    "free_text": frozenset({"kind", "text"}),
    "credential_added": frozenset({"kind", "credential_id", "integration_name", "auth_type"}),
    "credential_failed": frozenset(
        {
            "kind",
            "integration_name",
            "auth_type",
            "error_code",
            "error_message",
            "retryable",
            "provider_details",
        }
    ),
    "skipped": frozenset({"kind", "reason"}),
}


# credential_failed's error codes: the SDK's CredentialFailedResponse.error_code literals.
CREDENTIAL_ERROR_CODES = (
    "oauth_denied",
    "oauth_provider_error",
    "invalid_credentials",
    "network_error",
    "popup_closed",
    "timeout",
    "unknown",
)


# The JSON type of every answer field (the SDK's UserInputResponse models: modulex.types.realtime);
# null is the field left out. `kind` is checked by its value, `selected_values` item by item.
ANSWER_FIELD_TYPES: dict[str, tuple[type, str]] = {
    "selected_value": (str, "a string"),
    "free_text": (str, "a string"),
    "selected_values": (list, "a list of strings"),
    "answer": (bool, "true or false"),
    "text": (str, "a string"),
    "credential_id": (str, "a string"),
    "integration_name": (str, "a string"),
    "auth_type": (str, "a string"),
    "error_code": (str, "a string"),
    "error_message": (str, "a string"),
    "retryable": (bool, "true or false"),
    "provider_details": (dict, "an object"),
    "reason": (str, "a string"),
}


# A reason or an error message a client writes (a skipped answer's `reason`, a failed
# credential's `error_message`, a cancel's `reason`): at most this many characters. Each goes
# into a tool_result or cancelled event every listener gets and into the model's next call.
MAX_REASON_CHARS = 1000
_REASON_FIELDS = ("reason", "error_message")


def validate_answer(request: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """Check `answer` (a UserInputResponse dict) against `request`; returns the normalized answer.

    Raises InvalidAnswer for a wrong kind, a field the kind does not have (ANSWER_FIELDS), a
    field of the wrong JSON type (ANSWER_FIELD_TYPES; null counts as absent), a value not
    among the options, both a value and free text for a single choice, empty free text, a
    selection count outside [min_selections, max_selections], text whose length without
    surrounding whitespace (in code points) is outside the length bounds, a credential answer
    naming another integration than the question's, a credential_failed answer without an
    `error_code` of the SDK's (CREDENTIAL_ERROR_CODES), or a `reason` / `error_message` longer
    than MAX_REASON_CHARS.
    """
    kind = answer.get("kind")
    expected = request["kind"]
    if not isinstance(kind, str) or kind not in ANSWER_FIELDS:
        raise InvalidAnswer(f"'kind' must be one of {', '.join(ANSWER_FIELDS)}")
    _check_fields(kind, answer)
    if kind == "skipped":
        return {"kind": "skipped", "reason": answer.get("reason")}
    if expected == "credential_request":
        return _credential_answer(request, answer, kind)
    if kind != expected:
        raise InvalidAnswer(f"the question is {expected!r} but the answer is {kind!r}")
    if kind == "single_choice":
        return _single_choice(request, answer)
    if kind == "multi_choice":
        return _multi_choice(request, answer)
    if kind == "yes_no":
        if not isinstance(answer.get("answer"), bool):
            raise InvalidAnswer("yes_no needs 'answer' (true or false)")
        return {"kind": kind, "answer": answer["answer"]}
    text = answer.get("text")
    if not isinstance(text, str):
        raise InvalidAnswer("free_text needs 'text' (a string)")
    low, high = request.get("min_length") or 0, request.get("max_length")
    length = len(text.strip())  # surrounding whitespace is not an answer
    if length < low or (high is not None and length > high):
        raise InvalidAnswer(
            f"the text must be between {low} and {high if high is not None else 'any'} characters "
            "(surrounding whitespace not counted)"
        )
    return {"kind": kind, "text": text}


def _check_fields(kind: str, answer: dict[str, Any]) -> None:
    """Every field of `answer` is one its kind has, of its JSON type, and not too long."""
    unknown = sorted(set(answer) - ANSWER_FIELDS[kind])
    if unknown:
        raise InvalidAnswer(f"unknown field(s) in a {kind} answer: {', '.join(unknown)}")
    for name, value in answer.items():
        expected_type = ANSWER_FIELD_TYPES.get(name)
        if (
            expected_type is not None
            and value is not None
            and not isinstance(value, expected_type[0])
        ):
            raise InvalidAnswer(f"'{name}' of a {kind} answer must be {expected_type[1]}")
        if name in _REASON_FIELDS and value is not None and len(value) > MAX_REASON_CHARS:
            raise InvalidAnswer(
                f"'{name}' of a {kind} answer must be at most {MAX_REASON_CHARS} characters"
            )


def _credential_answer(
    request: dict[str, Any], answer: dict[str, Any], kind: str
) -> dict[str, Any]:
    """The answer of a credential_request: credential_added or credential_failed."""
    if kind not in ("credential_added", "credential_failed"):
        raise InvalidAnswer(
            "a credential_request is answered with credential_added, credential_failed or "
            f"skipped, not {kind!r}"
        )
    if kind == "credential_added" and not isinstance(answer.get("credential_id"), str):
        raise InvalidAnswer("credential_added needs 'credential_id'")
    named = answer.get("integration_name")
    if named is not None and named != request.get("integration_name"):
        raise InvalidAnswer(
            f"'integration_name' is {json.dumps(named)[:80]} but the question asks for "
            f"{json.dumps(request.get('integration_name'))}"
        )
    # required, as in the SDK
    if kind == "credential_failed" and answer.get("error_code") not in CREDENTIAL_ERROR_CODES:
        raise InvalidAnswer(
            f"credential_failed needs 'error_code', one of {', '.join(CREDENTIAL_ERROR_CODES)}"
        )
    return dict(answer)


def _single_choice(request: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    values = {o["value"] for o in request.get("options", [])}
    selected, free = answer.get("selected_value"), answer.get("free_text")
    if selected is None and free is None:
        raise InvalidAnswer("single_choice needs 'selected_value' (or 'free_text' when allowed)")
    if selected is not None and free is not None:
        raise InvalidAnswer("single_choice takes 'selected_value' or 'free_text', not both")
    if selected is not None and selected not in values:
        raise InvalidAnswer(f"{json.dumps(selected)} is not one of the options")
    if free is not None and not request.get("allow_free_text"):
        raise InvalidAnswer("this question does not allow free text")
    if free is not None and not free.strip():
        raise InvalidAnswer("'free_text' must not be empty")
    return {"kind": "single_choice", "selected_value": selected, "free_text": free}


def _multi_choice(request: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    values = {o["value"] for o in request.get("options", [])}
    selected = answer.get("selected_values")
    if not isinstance(selected, list) or not all(isinstance(v, str) for v in selected):
        raise InvalidAnswer("multi_choice needs 'selected_values' (a list of strings)")
    unknown = [v for v in selected if v not in values]
    if unknown:
        raise InvalidAnswer(f"{json.dumps(unknown[0])} is not one of the options")
    twice = next((v for i, v in enumerate(selected) if v in selected[:i]), None)
    if twice is not None:  # named, as an unknown value is
        raise InvalidAnswer(f"{json.dumps(twice)} is selected more than once")
    low, high = request.get("min_selections") or 0, request.get("max_selections")
    if len(selected) < low or (high is not None and len(selected) > high):
        raise InvalidAnswer(
            f"select between {low} and {high if high is not None else len(values)} options"
        )
    return {"kind": "multi_choice", "selected_values": selected}


def answer_as_tool_output(answer: dict[str, Any]) -> dict[str, Any]:
    """The tool result the model sees for an answer: {"success": bool, "answer": {...}}."""
    kind = answer.get("kind")
    if kind == "skipped":
        return {
            "success": False,
            "skipped": True,
            "reason": answer.get("reason"),
            "note": "The user skipped the question; continue without it.",
        }
    if kind == "credential_failed":
        return {
            "success": False,
            "error": answer.get("error_message") or "connecting the credential failed",
            "answer": answer,
        }
    return {"success": True, "answer": answer}
