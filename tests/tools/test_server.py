"""The server itself: health and the same stores on a PostgreSQL database (migrations, FTS path)."""

from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc

from loopline.tools.v1 import tools_pb2


async def test_health_reports_the_tools_service_serving(tools_service):
    stub = health_pb2_grpc.HealthStub(tools_service.channel)
    for service in ("", "loopline.tools.v1.ToolsService"):
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_credentials_and_knowledge_work_on_a_postgresql_database(start_tools, pg_database):
    tools = await start_tools(tools_database_url=pg_database)
    first = await tools.create_credential("http", {"token": "tok-1234567890ab"}, auth_type="bearer")
    second = await tools.create_credential(
        "http", {"token": "tok-1234567890cd"}, auth_type="bearer", make_default=True
    )
    assert first.is_default and second.is_default  # each was the default when created
    listed = await tools.stub.ListCredentials(
        tools_pb2.ListCredentialsRequest(organization_id="org-a")
    )
    assert [c.credential_id for c in listed.credentials if c.is_default] == [second.credential_id]

    kb = (
        await tools.stub.CreateKnowledgeBase(
            tools_pb2.CreateKnowledgeBaseRequest(organization_id="org-a", name="Docs")
        )
    ).knowledge_base
    await tools.stub.AddDocument(
        tools_pb2.AddDocumentRequest(
            organization_id="org-a",
            knowledge_base_id=kb.knowledge_base_id,
            name="a.txt",
            text="Refunds are paid within 30 days.\n\nShipping takes two days.",
        )
    )
    await tools.stub.AddDocument(
        tools_pb2.AddDocumentRequest(
            organization_id="org-a",
            knowledge_base_id=kb.knowledge_base_id,
            name="b.txt",
            text="Holidays are in August.",
        )
    )
    output = await tools.ok("search_knowledge", {"query": "refund"})
    assert [r["document_name"] for r in output["results"]] == ["a.txt"]
    assert output["results"][0]["score"] > 0
