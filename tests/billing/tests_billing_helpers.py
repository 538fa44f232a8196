"""Small helpers shared by the billing tests."""

from __future__ import annotations

from loopline.billing.v1 import billing_pb2


def admit_request(org: str, turn_key: str, credits: int = 0) -> billing_pb2.AdmitRequest:
    """An assistant-turn admission: usage type "run", rate class "sync_exec"."""
    return billing_pb2.AdmitRequest(
        organization_id=org, turn_key=turn_key, usage_type="run", rate_class="sync_exec", credits=credits
    )
