"""Loopline's services: gateway, orchestrator, billing and tools (one folder each).

Importing the package applies the gRPC core settings (`services.grpc_core`) before any
service module imports grpc.
"""

from services import grpc_core as _grpc_core  # noqa: F401 - must run before grpc is imported
