"""Loopline's services: gateway, orchestrator, billing and tools (one folder each)."""
