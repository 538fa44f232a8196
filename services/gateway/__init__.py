"""The gateway: HTTP API, API-key auth, org roles, SSE framing, error shapes, OpenAPI."""
