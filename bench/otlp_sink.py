"""An OTLP/HTTP receiver: POST /v1/traces with an ExportTraceServiceRequest (protobuf, maybe
gzip). `make bench --tracing` points the services at one that counts the spans and keeps nothing,
so tracing is measured end to end (the SDK encoding and posting batches), not an exporter failing
against a closed port; the tracing tests keep what they receive with `on_export`.
"""

from __future__ import annotations

import gzip
import http.server
import threading
from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class OtlpSink:
    """A thread serving POST /v1/traces on 127.0.0.1 (a free port): `spans` counts what came,
    and `on_export` (when given) gets each request, on the server's threads."""

    def __init__(
        self, on_export: Callable[[ExportTraceServiceRequest], None] | None = None
    ) -> None:
        self.spans = 0
        self.requests = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                sink._received(ExportTraceServiceRequest.FromString(body), on_export)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _received(
        self,
        request: ExportTraceServiceRequest,
        on_export: Callable[[ExportTraceServiceRequest], None] | None,
    ) -> None:
        count = sum(
            len(scope.spans)
            for resource in request.resource_spans
            for scope in resource.scope_spans
        )
        with self._lock:
            self.spans += count
            self.requests += 1
        if on_export is not None:
            on_export(request)

    def start(self) -> OtlpSink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
