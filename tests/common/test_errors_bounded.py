"""services.common.errors: an RpcError's message and metadata are bounded (they quote input)."""

from __future__ import annotations

import grpc

from services.common.errors import MAX_MESSAGE_CHARS, RpcError, bounded


def test_long_messages_and_metadata_are_cut_with_an_ellipsis():
    error = RpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        "UNKNOWN_MODEL",
        "unknown model " + "d" * 20_000,
        metadata={"model_id": "d" * 20_000, "short": "ok"},
    )
    assert len(error.message) == MAX_MESSAGE_CHARS and error.message.endswith("…")
    assert str(error) == error.message
    assert len(error.metadata["model_id"]) <= 500 and error.metadata["short"] == "ok"
    status = error.to_status()
    assert len(status.details) < 2_000
    assert sum(len(value) for _, value in status.trailing_metadata) < 4_000


def test_short_text_is_unchanged():
    assert bounded("unknown model 'x'") == "unknown model 'x'"
    assert bounded("x" * MAX_MESSAGE_CHARS) == "x" * MAX_MESSAGE_CHARS
