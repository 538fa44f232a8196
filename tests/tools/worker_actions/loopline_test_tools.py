"""A LangChain tool for the worker tests (the shape of the catalogue's actions)."""

from __future__ import annotations

from langchain_core.tools import tool  # type: ignore[import-not-found]


@tool
async def add(a: int, b: int) -> dict[str, int]:
    """Add two integers."""
    return {"sum": a + b}
