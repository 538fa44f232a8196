"""`CredentialInfo`: what the tools service shows of a stored credential (never its secret)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from services.common import db
from services.tools.models import Credential


@dataclass(frozen=True)
class CredentialInfo:
    """A credential's metadata (never its secret); `masked` is the masked secret. `metadata` holds
    `"needs_reconnect": true` when the credential does (see the module docstring)."""

    id: str
    org_id: str
    integration: str
    auth_type: str
    display_name: str
    is_default: bool
    created_at: datetime.datetime
    updated_at: datetime.datetime
    metadata: dict[str, Any]
    masked: str
    created_by: str = ""  # the creating user's id; "" when not recorded
    needs_reconnect: bool = False

    @classmethod
    def of(cls, row: Credential) -> CredentialInfo:
        """The metadata of a row."""
        metadata = dict(row.metadata_json or {})
        if row.needs_reconnect:
            metadata["needs_reconnect"] = True
        return cls(
            id=row.id,
            org_id=row.org_id,
            integration=row.integration,
            auth_type=row.auth_type,
            display_name=row.display_name,
            is_default=row.is_default,
            created_at=db.utc(row.created_at),
            updated_at=db.utc(row.updated_at),
            metadata=metadata,
            masked=row.masked_secret,
            created_by=row.created_by or "",
            needs_reconnect=bool(row.needs_reconnect),
        )

    def to_tool_json(self) -> dict[str, Any]:
        """The shape get_organization_credentials returns for one credential (with
        `"needs_reconnect": true` only when it does)."""
        shown = {
            "id": self.id,
            "integration": self.integration,
            "auth_type": self.auth_type,
            "display_name": self.display_name,
            "is_default": self.is_default,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }
        return {**shown, "needs_reconnect": True} if self.needs_reconnect else shown
