"""Lone UTF-16 surrogates: JSON may escape one ("\\ud800"), and Python reads it into a str that
protobuf, orjson and the databases refuse. In a model's reply or tool call, a tool's output or
a JSON upload, each becomes U+FFFD (an integer past 64 bits is written exactly) and the turn
goes on, rather than failing it ("Internal error while running the turn.") or answering 500."""

from __future__ import annotations

from services.common import pb
from services.tools.tools import cap_result
from tests.orchestrator.helpers import run_turn, types


async def test_a_models_text_and_tool_call_with_a_lone_surrogate_keep_the_turn_going(services):
    tool_input = {
        "integration": "loopline",
        "action": "echo",
        "parameters": {"message": "a\ud800b"},
    }
    async with services.client() as client:
        body, frames = await run_turn(
            client,
            {"say": "look\ud800", "tool": "execute_integration_tool", "input": tool_input},
            {"say": "done \udfff"},
        )
        kinds = types(frames)
        assert (
            "error" not in kinds and kinds[-1] == "done" and not frames[-1]["data"].get("error")
        ), frames
        chunks = "".join(f["data"]["chunk"] for f in frames if f["type"] == "response_chunk")
        assert chunks == "look\ufffddone \ufffd"
        call, result = frames[kinds.index("tool_call")], frames[kinds.index("tool_result")]
        assert call["data"]["input"]["parameters"] == {"message": "a\ufffdb"}
        assert result["data"]["output"]["result"]["message"] == "a\ufffdb"
        assert frames[-1]["data"]["response"] == "done \ufffd"
        chat = await client.get(f"/assistant/chat/{body['chat_id']}")
        assert chat.status_code == 200 and chat.json()["messages"][-1]["content"] == "done \ufffd"


def test_a_tool_output_with_a_lone_surrogate_or_a_huge_integer_is_written_not_refused():
    value, truncated, size = cap_result({"lone": "\ud800x", "ok": "é"}, 1000)
    assert (
        value == {"lone": "\ufffdx", "ok": "é"}
        and not truncated
        and size == len('{"lone":"\ufffdx","ok":"é"}'.encode())
    )
    assert pb.json_bytes({"lone": "\ud800x"}) == '{"lone":"\ufffdx"}'.encode()
    assert (
        pb.json_bytes({"v": 18446744073709551616, "n": float("nan"), "t": "\udc00"})
        == '{"v":18446744073709551616,"n":null,"t":"\ufffd"}'.encode()
    )
    assert pb.scrub("plain ascii") == "plain ascii" and pb.scrub(["\ud83d\ude00"]) == [
        "\ufffd\ufffd"
    ]
    assert pb.scrub({"k\udc00": {"x": ("\ud800",)}}) == {"k\ufffd": {"x": ["\ufffd"]}}
