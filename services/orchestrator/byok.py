"""Bring your own key: an organization's model key, read from the tools service when needed."""

from __future__ import annotations

import grpc

from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common.errors import status_details
from services.orchestrator.providers.registry import (
    CredentialUndecryptable,
    SecretResolver,
)

UNDECRYPTABLE_REASON = "CREDENTIAL_UNDECRYPTABLE"


def tools_secret_resolver(tools: tools_pb2_grpc.ToolsServiceStub) -> SecretResolver:
    """A SecretResolver over ToolsService.ResolveCredentialSecret.

    Raises LookupError when the credential is absent, another organization's or for another
    integration (NOT_FOUND, INVALID_ARGUMENT); registry.CredentialUndecryptable (with the tools
    service's message, which names the credential and the fix) when it answers FAILED_PRECONDITION
    CREDENTIAL_UNDECRYPTABLE (no configured key decrypts the secret: tools.proto); other
    failures (UNAVAILABLE, DEADLINE_EXCEEDED, ...) propagate as grpc.aio.AioRpcError.
    """

    async def resolve(organization_id: str, credential_id: str, integration: str) -> str:
        try:
            response = await tools.ResolveCredentialSecret(
                tools_pb2.ResolveCredentialSecretRequest(
                    organization_id=organization_id,
                    credential_id=credential_id,
                    integration_name=integration,
                ),
                timeout=10,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise LookupError(credential_id) from None
            if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                parsed = status_details(error)
                if parsed.reason == UNDECRYPTABLE_REASON:
                    raise CredentialUndecryptable(credential_id, parsed.message) from None
            raise
        return response.secret

    return resolve
