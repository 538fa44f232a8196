"""An OTLP/HTTP receiver that counts the spans it is sent and keeps nothing, for `--tracing`.

With it the benchmark measures the services with tracing on end to end (the SDK's batch
processor encoding and posting spans), not an exporter failing against a closed port.
"""

from __future__ import annotations

import http.server
import threading
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class OtlpSink:
    """A thread serving POST /v1/traces on 127.0.0.1 (a free port); `spans` counts what came."""

    def __init__(self) -> None:
        self.spans = 0
        self.requests = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = ExportTraceServiceRequest.FromString(body)
                count = sum(
                    len(scope.spans)
                    for resource in request.resource_spans
                    for scope in resource.scope_spans
                )
                with sink._lock:
                    sink.spans += count
                    sink.requests += 1
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> OtlpSink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
