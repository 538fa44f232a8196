"""Question tools' input and answers (services/orchestrator/hitl.py): min_selections "abc" is
refused rather than giving the model Python's int() text, max_length "zz" is not ignored, two
spaces do not pass min_length 2, and a single choice takes a selected_value or free_text, not
both."""

from __future__ import annotations

import pytest

from services.orchestrator import hitl
from services.orchestrator.hitl import InvalidAnswer, build_request, validate_answer

OPTIONS = [{"value": "a", "label": "A"}, {"value": "b", "label": "B"}]


@pytest.mark.parametrize(
    ("tool", "field", "value"),
    [
        ("ask_user_multi_choice", "min_selections", "abc"),
        ("ask_user_multi_choice", "max_selections", 1.5),
        ("ask_user_free_text", "max_length", "zz"),
        ("ask_user_free_text", "min_length", -1),
        ("ask_user_free_text", "min_length", True),
    ],
)
def test_counts_must_be_whole_numbers_and_the_error_names_the_field(tool, field, value):
    question = {"message": "pick", "options": OPTIONS} if "choice" in tool else {"message": "say"}
    with pytest.raises(
        ValueError, match=rf"^input\.{field}: must be (of type integer|>= 0)"
    ) as raised:
        build_request(tool, {**question, field: value}, "req_1")
    assert "int()" not in str(raised.value) and repr(value) not in str(raised.value)


def test_whole_number_floats_and_absent_counts_are_fine():
    request = build_request("ask_user_free_text", {"message": "say", "min_length": 2.0}, "req_1")
    assert request["min_length"] == 2 and request["max_length"] is None


def test_free_text_length_ignores_surrounding_whitespace():
    request = build_request("ask_user_free_text", {"message": "say", "min_length": 2}, "req_1")
    with pytest.raises(InvalidAnswer):
        validate_answer(request, {"kind": "free_text", "text": "  "})
    assert validate_answer(request, {"kind": "free_text", "text": " ok "})["text"] == " ok "


def test_single_choice_takes_a_value_or_free_text_not_both():
    request = build_request(
        "ask_user_choice", {"message": "pick", "options": OPTIONS, "allow_free_text": True}, "req_1"
    )
    with pytest.raises(InvalidAnswer, match="not both"):
        validate_answer(request, {"kind": "single_choice", "selected_value": "a", "free_text": "c"})
    assert validate_answer(request, {"kind": "single_choice", "free_text": "c"})["free_text"] == "c"


def test_an_answer_with_a_field_its_kind_does_not_have_is_refused():
    # an unknown field (e.g. "extra": <100 KB>) is refused, so it neither starts a run nor is stored
    request = build_request("ask_user_yes_no", {"message": "ok?"}, "req_1")
    with pytest.raises(InvalidAnswer, match="unknown field"):
        validate_answer(request, {"kind": "yes_no", "answer": True, "extra": "x" * 100_000})
    assert validate_answer(request, {"kind": "yes_no", "answer": True}) == {
        "kind": "yes_no",
        "answer": True,
    }
    credential = build_request(
        "request_credential", {"message": "connect", "integration": "github"}, "req_2"
    )
    sdk_shaped = {
        "kind": "credential_failed",
        "integration_name": "github",
        "auth_type": "oauth2",
        "error_code": "popup_closed",
        "error_message": "closed",
        "retryable": True,
        "provider_details": None,
    }
    assert (
        validate_answer(credential, sdk_shaped)["error_code"] == "popup_closed"
    )  # every SDK field is known


@pytest.mark.parametrize(
    "answer",
    [
        {"kind": "single_choice", "selected_value": ["a"]},
        {"kind": "single_choice", "selected_value": {"a": 1}},
        {"kind": "single_choice", "selected_value": True},
        {"kind": "single_choice", "free_text": ["x"]},
        {"kind": "single_choice", "free_text": {"x": 1}},
        {"kind": ["single_choice"]},
        {"kind": {"a": 1}},
        {"kind": 5},
    ],
)
def test_a_single_choice_answer_of_the_wrong_json_type_is_refused_not_a_crash(answer):
    # a list or object selected_value is refused, not a TypeError (500); a list free_text is
    # refused, not stored
    request = build_request(
        "ask_user_choice", {"message": "pick", "options": OPTIONS, "allow_free_text": True}, "req_1"
    )
    with pytest.raises(InvalidAnswer, match="must be"):
        validate_answer(request, answer)


@pytest.mark.parametrize(
    ("tool", "answer", "field"),
    [
        (
            "ask_user_multi_choice",
            {"kind": "multi_choice", "selected_values": "a"},
            "selected_values",
        ),
        ("ask_user_yes_no", {"kind": "yes_no", "answer": "yes"}, "answer"),
        ("ask_user_free_text", {"kind": "free_text", "text": ["x"]}, "text"),
        ("ask_user_yes_no", {"kind": "skipped", "reason": {"why": "busy"}}, "reason"),
        (
            "request_credential",
            {"kind": "credential_added", "credential_id": "c1", "integration_name": 7},
            "integration_name",
        ),
        (
            "request_credential",
            {"kind": "credential_failed", "error_message": ["x"]},
            "error_message",
        ),
        ("request_credential", {"kind": "credential_failed", "retryable": "yes"}, "retryable"),
        (
            "request_credential",
            {"kind": "credential_failed", "provider_details": "x"},
            "provider_details",
        ),
    ],
)
def test_every_answer_field_has_its_json_type(tool, answer, field):
    question = (
        {"message": "pick", "options": OPTIONS}
        if "choice" in tool
        else {"message": "say", "integration": "github"}
        if tool == "request_credential"
        else {"message": "say"}
    )
    request = build_request(tool, question, "req_1")
    with pytest.raises(InvalidAnswer, match=f"'{field}' of a {answer['kind']} answer must be"):
        validate_answer(request, answer)


def test_a_value_not_among_the_options_is_named_in_json():
    request = build_request("ask_user_choice", {"message": "pick", "options": OPTIONS}, "req_1")
    with pytest.raises(InvalidAnswer, match='^"zz" is not one of the options$'):
        validate_answer(request, {"kind": "single_choice", "selected_value": "zz"})
    assert validate_answer(request, {"kind": "skipped", "reason": None}) == {
        "kind": "skipped",
        "reason": None,
    }


CREDENTIAL_QUESTION = {"message": "connect it", "integration": "http"}


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (
            {
                "kind": "credential_added",
                "credential_id": "cred_1",
                "integration_name": "postgresql",
                "auth_type": "bearer",
            },
            '\'integration_name\' is "postgresql" but the question asks for "http"',
        ),
        (
            {
                "kind": "credential_failed",
                "integration_name": "github",
                "auth_type": "oauth2",
                "error_code": "timeout",
                "error_message": "x",
            },
            '\'integration_name\' is "github" but the question asks for "http"',
        ),
        (
            {
                "kind": "credential_failed",
                "integration_name": "http",
                "auth_type": "oauth2",
                "error_code": "bogus",
                "error_message": "x",
            },
            "credential_failed needs 'error_code', one of oauth_denied, oauth_provider_error, "
            "invalid_credentials, network_error, popup_closed, timeout, unknown",
        ),
        (
            {"kind": "credential_failed"},
            "credential_failed needs 'error_code', one of oauth_denied, oauth_provider_error, "
            "invalid_credentials, network_error, popup_closed, timeout, unknown",
        ),
        (
            {"kind": "credential_failed", "error_code": None},
            "credential_failed needs 'error_code', one of oauth_denied, oauth_provider_error, "
            "invalid_credentials, network_error, popup_closed, timeout, unknown",
        ),
    ],
)
def test_a_credential_answer_must_name_the_questions_integration_and_an_sdk_error_code(
    answer, message
):
    # a wrong integration or error code is refused, not stored and told to the model
    request = build_request("request_credential", CREDENTIAL_QUESTION, "req_1")
    with pytest.raises(InvalidAnswer) as raised:
        validate_answer(request, answer)
    assert str(raised.value) == message


def test_credential_answers_of_the_sdk_shape_are_taken():
    request = build_request("request_credential", CREDENTIAL_QUESTION, "req_1")
    added = {
        "kind": "credential_added",
        "credential_id": "cred_1",
        "integration_name": "http",
        "auth_type": "bearer_token",
    }
    assert validate_answer(request, added) == added
    for code in ("oauth_denied", "unknown"):
        failed = {
            "kind": "credential_failed",
            "integration_name": "http",
            "auth_type": "oauth2",
            "error_code": code,
            "error_message": "no",
        }
        assert validate_answer(request, failed) == failed


@pytest.mark.parametrize("free_text", ["", "   "])
def test_empty_free_text_is_not_an_answer_to_a_single_choice(free_text):
    request = build_request(
        "ask_user_choice", {"message": "pick", "options": OPTIONS, "allow_free_text": True}, "req_1"
    )
    with pytest.raises(InvalidAnswer, match="'free_text' must not be empty"):
        validate_answer(request, {"kind": "single_choice", "free_text": free_text})
    assert (
        validate_answer(request, {"kind": "single_choice", "free_text": " mine "})["free_text"]
        == " mine "
    )


def test_the_length_error_says_surrounding_whitespace_is_not_counted():
    request = build_request(
        "ask_user_free_text", {"message": "say", "min_length": 3, "max_length": 5}, "req_1"
    )
    with pytest.raises(
        InvalidAnswer,
        match=r"^the text must be between 3 and 5 characters "
        r"\(surrounding whitespace not counted\)$",
    ):
        validate_answer(request, {"kind": "free_text", "text": " ab "})


def test_a_value_selected_twice_is_named():
    # the duplicate value is named, as an unknown value is
    request = build_request(
        "ask_user_multi_choice", {"message": "pick", "options": OPTIONS}, "req_1"
    )
    with pytest.raises(InvalidAnswer, match='^"b" is selected more than once$'):
        validate_answer(request, {"kind": "multi_choice", "selected_values": ["a", "b", "b"]})
    assert validate_answer(request, {"kind": "multi_choice", "selected_values": ["b", "a"]})[
        "selected_values"
    ] == ["b", "a"]


@pytest.mark.parametrize(
    ("tool", "kind", "field"),
    [
        ("ask_user_yes_no", "skipped", "reason"),
        ("request_credential", "skipped", "reason"),
        ("request_credential", "credential_failed", "error_message"),
    ],
)
def test_a_reason_or_error_message_is_at_most_1000_characters(tool, kind, field):
    # longer text is refused: it would be stored and fed to the model
    question = (
        {"message": "connect it", "integration": "http"}
        if tool == "request_credential"
        else {"message": "say"}
    )
    request = build_request(tool, question, "req_1")
    answer = {"kind": kind, **({"error_code": "timeout"} if kind == "credential_failed" else {})}
    assert (
        validate_answer(request, {**answer, field: "r" * hitl.MAX_REASON_CHARS})[field]
        == "r" * 1000
    )
    with pytest.raises(
        InvalidAnswer, match=f"^'{field}' of a {kind} answer must be at most 1000 characters$"
    ):
        validate_answer(request, {**answer, field: "r" * (hitl.MAX_REASON_CHARS + 1)})
