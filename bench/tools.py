"""The tools workload: the overhead of a no-op tool call, and knowledge search latency.

grpc and the generated stubs are imported inside the functions, after `bench.run` has applied
the services' gRPC core settings (they take effect only before grpc is first imported).
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

from bench.deploy import Deployment
from bench.stats import rounded, summary


def _corpus_paragraph(rng: Any, vocabulary: list[str], chars: int = 900) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(vocabulary)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


async def _noop_calls(
    dep: Deployment, stub: Any, health: Any, org: str, calls: int
) -> tuple[list[float], list[float], float]:
    """`calls` sequential echo tool calls, each followed by a health Check on the same channel:
    the seconds of each, and the tools service's CPU seconds over them."""
    from google.protobuf import struct_pb2
    from grpc_health.v1 import health_pb2

    from loopline.tools.v1 import tools_pb2

    echo_input = struct_pb2.Struct()
    echo_input.update(
        {"integration": "loopline", "action": "echo", "parameters": {"message": "ping"}}
    )
    for _ in range(20):  # warm-up
        await stub.ExecuteTool(
            tools_pb2.ExecuteToolRequest(
                organization_id=org, tool="execute_integration_tool", input=echo_input
            ),
            timeout=10,
        )
        await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    tool_s, health_s = [], []
    cpu0 = dep.cpu()["tools"]
    for i in range(calls):
        t0 = time.perf_counter()
        response = await stub.ExecuteTool(
            tools_pb2.ExecuteToolRequest(
                organization_id=org,
                tool="execute_integration_tool",
                input=echo_input,
                run_id="bench",
                tool_call_id=f"c{i}",
            ),
            timeout=10,
        )
        t1 = time.perf_counter()
        await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        t2 = time.perf_counter()
        if not response.success:
            raise RuntimeError(f"echo failed: {response.error}")
        tool_s.append(t1 - t0)
        health_s.append(t2 - t1)
    return tool_s, health_s, dep.cpu()["tools"] - cpu0


async def _load_corpus(
    stub: Any, org: str, rng: random.Random, vocabulary: list[str], chunks: int
) -> tuple[str, int, float]:
    """A knowledge base filled with `chunks` chunks, 100 per document: its id, the chunks
    loaded and the seconds it took."""
    from loopline.tools.v1 import tools_pb2

    base = (
        await stub.CreateKnowledgeBase(
            tools_pb2.CreateKnowledgeBaseRequest(organization_id=org, name="bench corpus"),
            timeout=30,
        )
    ).knowledge_base
    loaded = 0
    load_started = time.monotonic()
    per_document = 100
    while loaded < chunks:
        count = min(per_document, chunks - loaded)
        text = "\n\n".join(_corpus_paragraph(rng, vocabulary) for _ in range(count))
        await stub.AddDocument(
            tools_pb2.AddDocumentRequest(
                organization_id=org,
                knowledge_base_id=base.knowledge_base_id,
                name=f"doc{loaded}.txt",
                content_type="text/plain",
                text=text,
            ),
            timeout=120,
        )
        loaded += count
    return base.knowledge_base_id, loaded, time.monotonic() - load_started


async def _searches(
    stub: Any, org: str, rng: random.Random, vocabulary: list[str], base_id: str, searches: int
) -> tuple[list[float], int]:
    """`searches` two-word searches (top_k 5): the seconds of each and the results found."""
    from loopline.tools.v1 import tools_pb2

    search_s: list[float] = []
    hits = 0
    for _ in range(searches):
        query = f"{rng.choice(vocabulary)} {rng.choice(vocabulary)}"
        t0 = time.perf_counter()
        found = await stub.SearchKnowledge(
            tools_pb2.SearchKnowledgeRequest(
                organization_id=org,
                query=query,
                knowledge_base_ids=[base_id],
                top_k=5,
                mode=tools_pb2.SEARCH_MODE_KEYWORD,  # the knowledge workload measures the others
            ),
            timeout=30,
        )
        search_s.append(time.perf_counter() - t0)
        hits += len(found.results)
    return search_s, hits


async def workload_tools(dep: Deployment, calls: int, chunks: int, searches: int) -> dict[str, Any]:
    """The overhead of a no-op tool call and search latency over `chunks` chunks, over gRPC.

    No-op: ExecuteTool(execute_integration_tool loopline.echo) sequentially, beside a
    grpc.health.v1 Check on the same channel as the bare round-trip baseline; the overhead is
    the difference of the medians. Search: a knowledge base filled with `chunks` chunks of
    ~900 characters of pseudo-words (100 chunks per document), then `searches` keyword
    SearchKnowledge calls with two-word queries, top_k 5; the knowledge base is deleted after,
    so its embedding (in the background) does not weigh on the workloads that follow.
    """
    import grpc
    from grpc_health.v1 import health_pb2_grpc

    from loopline.tools.v1 import tools_pb2, tools_pb2_grpc

    org = f"org_bench_tools_{uuid.uuid4().hex[:8]}"
    channel = grpc.aio.insecure_channel(
        dep.grpc_addr["tools"],
        options=[("grpc.enable_http_proxy", 0), ("grpc.max_send_message_length", 64 << 20)],
    )
    stub = tools_pb2_grpc.ToolsServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    try:
        tool_s, health_s, tools_cpu = await _noop_calls(dep, stub, health, org, calls)
        rng = random.Random(20261130)
        vocabulary = [
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10)))
            for _ in range(5000)
        ]
        base_id, loaded, load_s = await _load_corpus(stub, org, rng, vocabulary, chunks)
        search_s, hits = await _searches(stub, org, rng, vocabulary, base_id, searches)
        await stub.DeleteKnowledgeBase(
            tools_pb2.DeleteKnowledgeBaseRequest(organization_id=org, knowledge_base_id=base_id),
            timeout=60,
        )
    finally:
        await channel.close()
    tool_summary, health_summary = summary(tool_s), summary(health_s)
    overhead = (tool_summary["p50_ms"] or 0) - (health_summary["p50_ms"] or 0)
    return {
        "noop_calls": len(tool_s),
        "noop_tool_call": tool_summary,
        "grpc_roundtrip": health_summary,
        "noop_overhead_p50_ms": rounded(overhead),
        "tools_cpu_ms_per_noop_call": rounded(tools_cpu * 1000 / max(1, len(tool_s))),
        "chunks": loaded,
        "load_s": rounded(load_s),
        "searches": len(search_s),
        "search": summary(search_s),
        "mean_results_per_search": rounded(hits / max(1, len(search_s))),
    }
