"""Organization ids: the one rule for an id a new organization or billing account may have.

An organization id travels as the `X-Organization-ID` header and names the organization's
rows in every service. It is 1 to `MAX_ORG_ID_CHARS` (128, billing's column) visible ASCII
characters ('!' to '~'): empty it can never be sent, and outside visible ASCII clients send it
in a header encoding the gateway does not read it back in (HTTP field values are ASCII in
practice, RFC 9110 §5.5: curl sends 'org_ü' as UTF-8, which matched no organization).
"""

from __future__ import annotations

import argparse

MAX_ORG_ID_CHARS = 128


def org_id_error(org_id: str) -> str | None:
    """Why `org_id` cannot be an organization's id (module docstring), or None when it can."""
    if not 0 < len(org_id) <= MAX_ORG_ID_CHARS or not all("!" <= c <= "~" for c in org_id):
        return f"an organization id is 1 to {MAX_ORG_ID_CHARS} visible ASCII characters (no spaces)"
    return None


def org_id_arg(text: str) -> str:
    """An argparse type for an organization id (`org_id_error`); argparse reports a bad one (exit 2)."""
    problem = org_id_error(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text
