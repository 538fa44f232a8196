"""Organization ids: the one rule for an id a new organization or billing account may have.

An organization id travels as the `X-Organization-ID` header and names the organization's
rows in every service. It is 1 to `MAX_ORG_ID_CHARS` (128, billing's column) visible ASCII
characters ('!' to '~'): empty it can never be sent, and outside visible ASCII clients send it
in a header encoding the gateway does not read it back in (HTTP field values are ASCII in
practice, RFC 9110 §5.5: curl sends 'org_ü' as UTF-8, which matched no organization).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

MAX_ORG_ID_CHARS = 128
# What str(uuid.uuid4()) gives: lower-case hexadecimal in the 8-4-4-4-12 form, 36 characters.
_ROW_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def org_id_error(org_id: str) -> str | None:
    """Why `org_id` cannot be an organization's id (module docstring), or None when it can."""
    if not 0 < len(org_id) <= MAX_ORG_ID_CHARS or not all("!" <= c <= "~" for c in org_id):
        return f"an organization id is 1 to {MAX_ORG_ID_CHARS} visible ASCII characters (no spaces)"
    return None


def org_id_arg(text: str) -> str:
    """An argparse type for an organization id (`org_id_error`); argparse reports a bad one (exit
    2)."""
    problem = org_id_error(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def request_organization_check(
    domain: str, empty_reason: str | None = None
) -> Callable[[Any], None]:
    """A `rpc_handler(check=...)` for a gRPC service: the organization a request names
    (`caller.organization_id`, else `organization_id`; a request with neither is not checked)
    must be one an organization can have (`org_id_error`), else RpcError INVALID_ARGUMENT
    INVALID_ORGANIZATION_ID in `domain`; an empty one is `empty_reason` ("organization_id is
    required") when given. The gateway checks X-Organization-ID the same way; each service
    checks what reaches it over gRPC, so that no account or row gets an id its own admin
    commands refuse, or a NUL PostgreSQL cannot store."""
    import grpc  # noqa: PLC0415 - the admin CLIs import this module without grpc

    from services.common.errors import RpcError  # noqa: PLC0415 - errors imports nothing of this module

    def check(request: Any) -> None:
        fields = request.DESCRIPTOR.fields_by_name
        if "caller" in fields:
            name, organization_id = "caller.organization_id", request.caller.organization_id
        elif "organization_id" in fields:
            name, organization_id = "organization_id", request.organization_id
        else:
            return
        if not organization_id and empty_reason is not None:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT, empty_reason, f"{name} is required", domain=domain
            )
        problem = org_id_error(organization_id)
        if problem is not None:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_ORGANIZATION_ID",
                f"{name}: {problem}",
                domain=domain,
            )

    return check


def is_row_id(value: str) -> bool:
    """Whether `value` can be the id of a row the services mint as str(uuid.uuid4()) (chats, runs
    and questions in the orchestrator; credentials, knowledge bases and documents in tools).

    One that cannot (another form of UUID, any other text, U+0000, which PostgreSQL's text cannot
    hold and answered as INTERNAL) is unknown: the services answer it as they answer an absent id
    (NOT_FOUND, or nothing matched), without a database query."""
    return _ROW_ID.fullmatch(value) is not None
