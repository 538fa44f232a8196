"""`services.gateway.errors.grpc_error_response`: statuses with headers (README error table)."""

from __future__ import annotations

import grpc

from services.common.errors import RpcError
from services.gateway.errors import grpc_error_response


def _failed(error: RpcError) -> grpc.aio.AioRpcError:
    status = error.to_status()
    return grpc.aio.AioRpcError(
        status.code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*status.trailing_metadata),
        status.details,
    )


def test_a_service_that_is_down_is_503_with_retry_after():
    # the README promises Retry-After with 503, as with 429
    plain = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "connect failed"
    )
    response = grpc_error_response(plain)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    ours = grpc_error_response(
        _failed(
            RpcError(
                grpc.StatusCode.UNAVAILABLE,
                "BILLING_UNAVAILABLE",
                "Billing is unavailable",
                retry_after_s=3,
            )
        )
    )
    assert ours.status_code == 503 and ours.headers["retry-after"] == "3"


def test_our_4xx_keep_their_message_and_grpc_own_4xx_codes_are_500():
    ours = grpc_error_response(
        _failed(RpcError(grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_MODEL", "unknown model 'x'"))
    )
    assert ours.status_code == 400 and ours.body == b'{"detail":"unknown model \'x\'"}'
    library = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        "received metadata size exceeds hard limit",
    )
    response = grpc_error_response(library)
    assert response.status_code == 500 and b"metadata" not in response.body
