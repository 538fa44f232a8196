"""The tools service: the tool catalogue, integrations, encrypted org credentials and knowledge
search.

It executes the assistant profile's non-HITL tools (`get_available_integrations`,
`get_integration_details`, `get_organization_credentials`, `execute_integration_tool`,
`search_knowledge`) for the orchestrator over `loopline.tools.v1.ToolsService`.
"""
