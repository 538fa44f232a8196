"""Knowledge search routes: search one or several knowledge bases, hybrid search, and the
context of a query for a model's prompt (over the tools service's SearchKnowledge).

Shapes follow the official SDK (`modulex/resources/knowledge.py`, `types/knowledge.py`).
Scores are from 0 to 1: `semantic_score` the cosine similarity of the query's and the chunk's
embeddings, `keyword_score` the share of the query's words the chunk holds, `score`
the one the search type ranks by (hybrid: their weighted mean). Every route requires an owner
or admin, authenticated before anything is looked up; a knowledge base of another
organization is 404; bad input is 400 `{"detail": ...}`.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.gateway.bodies import check_fields
from services.gateway.errors import BodyError, detail
from services.gateway.identity import Principal
from services.gateway.openapi import error_responses, keyed
from services.gateway.routes.fields import (
    MAX_ID_CHARS,
    MAX_SEARCH_BASES,
    TIMEOUT_S,
    Who,
    body_of,
    int_field,
    json_body,
    number_field,
    string_field,
    text_schema,
    tools_of,
)
from services.gateway.routes.knowledge import owned_bases
from services.gateway.schemas import (
    Context,
    ContextSource,
    HybridSearch,
    MultiSearch,
    Search,
    SearchMatch,
)

#: A body's `search_type` -> the tools service's SearchMode.
SEARCH_TYPES: dict[str, tools_pb2.SearchMode] = {
    "semantic": tools_pb2.SEARCH_MODE_SEMANTIC,
    "keyword": tools_pb2.SEARCH_MODE_KEYWORD,
    "hybrid": tools_pb2.SEARCH_MODE_HYBRID,
}
#: What POST .../search searches by when the body names no search_type: the SDK calls it
#: "semantic vector search".
DEFAULT_SEARCH_TYPE = "semantic"
#: The largest `max_tokens` of retrieve-context.
MAX_CONTEXT_TOKENS = 32_000
#: A word token, as the tools service counts a document's (knowledge.count_tokens).
_TOKEN = re.compile(r"\w+", re.UNICODE)


def _score(default: float, description: str) -> dict[str, Any]:
    return {
        "type": "number",
        "minimum": 0,
        "maximum": 1,
        "default": default,
        "description": description,
    }


_TOP_K = {"type": "integer", "minimum": 1, "maximum": 50, "default": 5}
_MIN_SCORE = _score(0.0, "Only matches whose score is at least this (scores are 0 to 1).")
_SEARCH_TYPE = {
    "enum": list(SEARCH_TYPES),
    "default": DEFAULT_SEARCH_TYPE,
    "description": "semantic: by meaning (embeddings); keyword: by the query's words; hybrid:"
    " both, weighted 0.7 and 0.3.",
}
# refused when truthy: only an empty value passes
_FILTERS: dict[str, Any] = {
    "enum": [None, False, 0, "", [], {}],
    "description": "Not supported: only an empty value (null, {}, ...) is accepted.",
}
SEARCH_BODY = json_body(
    {
        "query": text_schema("query", required=True),
        "top_k": _TOP_K,
        "min_score": _MIN_SCORE,
        "search_type": _SEARCH_TYPE,
        "filters": _FILTERS,
        "include_content": {"type": "boolean", "default": True},
        "include_metadata": {"type": "boolean", "default": True},
    },
    ["query"],
)
MULTI_SEARCH_BODY = json_body(
    {
        "knowledge_base_ids": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_SEARCH_BASES,
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS},
        },
        "query": text_schema("query", required=True),
        "top_k": _TOP_K,
        "min_score": _MIN_SCORE,
        "search_type": _SEARCH_TYPE,
    },
    ["knowledge_base_ids", "query"],
)
HYBRID_SEARCH_BODY = json_body(
    {
        "query": text_schema("query", required=True),
        "top_k": _TOP_K,
        "keyword_weight": _score(0.3, "The keyword score's weight (not both weights 0)."),
        "semantic_weight": _score(0.7, "The semantic score's weight (not both weights 0)."),
        "min_score": _MIN_SCORE,
        "filters": _FILTERS,
    },
    ["query"],
)
CONTEXT_BODY = json_body(
    {
        "query": text_schema("query", required=True),
        "max_tokens": {
            "type": "integer",
            "minimum": 1,
            "maximum": MAX_CONTEXT_TOKENS,
            "default": 2000,
            "description": "The context's budget in word tokens, headers included.",
        },
        "top_k": {**_TOP_K, "default": 10},
        "min_score": _score(0.3, "Only chunks whose hybrid score is at least this."),
    },
    ["query"],
)


def score_field(body: dict[str, Any], name: str, default: float) -> float:
    """`body[name]` (else `default`) as a number from 0 to 1; BodyError 400 otherwise."""
    value = number_field(body, name, default)
    if not 0 <= value <= 1:
        raise BodyError(400, f"{name} must be a number between 0 and 1")
    return value


def search_type_field(body: dict[str, Any]) -> str:
    """The body's `search_type` (DEFAULT_SEARCH_TYPE when absent); 400 for any other value
    (null too, as for the other fields)."""
    value = body.get("search_type", DEFAULT_SEARCH_TYPE)
    if not isinstance(value, str) or value not in SEARCH_TYPES:
        raise BodyError(400, f"search_type must be one of {', '.join(SEARCH_TYPES)}")
    return str(value)


def match_json(
    r: tools_pb2.KnowledgeSearchResult, include_content: bool = True, include_metadata: bool = True
) -> SearchMatch:
    """The SDK's SearchMatch of a search result, with its semantic and keyword scores."""
    return {
        "chunk_id": r.chunk_id,
        "document_id": r.document_id,
        "document_filename": r.document_name,
        "chunk_index": r.chunk_index,
        "score": r.score,
        "content": r.content if include_content else None,
        "metadata": {"knowledge_base_id": r.knowledge_base_id} if include_metadata else None,
        "semantic_score": r.semantic_score,
        "keyword_score": r.keyword_score,
    }


async def search_knowledge(
    tools: tools_pb2_grpc.ToolsServiceStub,
    org_id: str,
    query: str,
    ids: list[str],
    top_k: int,
    *,
    mode: tools_pb2.SearchMode,
    min_score: float,
    weights: tuple[float, float] = (0.0, 0.0),
) -> list[tools_pb2.KnowledgeSearchResult]:
    """The tools service's results, best first; `weights` (semantic, keyword): (0, 0) for its
    defaults."""
    response = await tools.SearchKnowledge(
        tools_pb2.SearchKnowledgeRequest(
            organization_id=org_id,
            query=query,
            knowledge_base_ids=ids,
            top_k=top_k,
            mode=mode,
            semantic_weight=weights[0],
            keyword_weight=weights[1],
            min_score=min_score,
        ),
        timeout=TIMEOUT_S,
    )
    return list(response.results)


def count_tokens(text: str) -> int:
    """The word tokens of `text` (`\\w+`), as the tools service counts a document's."""
    return sum(1 for _ in _TOKEN.finditer(text))


def first_words(text: str, budget: int) -> str:
    """The longest start of `text` that holds at most `budget` word tokens and ends at a word
    boundary (white space: "don't" is never cut after "don"; "days." keeps its period), then
    "…"; `text` itself when it fits. A first word longer than the budget is cut after its
    tokens."""
    end = None
    for count, match in enumerate(_TOKEN.finditer(text), start=1):
        if count == budget:
            end = match.end()
            break
    if end is None:
        return text
    stop = end
    while stop < len(text) and not text[stop].isspace() and not _TOKEN.match(text, stop):
        stop += 1  # the punctuation that ends the word ("days.")
    if not text[stop:].strip():
        return text
    cut = stop
    if not text[stop].isspace():  # the budget ends inside a word ("don" of "don't")
        cut = end
        while cut > 0 and not text[cut - 1].isspace():
            cut -= 1
    return text[: cut or end].rstrip() + "…"


def assemble_context(
    matches: list[tools_pb2.KnowledgeSearchResult], max_tokens: int
) -> tuple[str, list[ContextSource]]:
    """The matches, best first, as one text within `max_tokens` word tokens: each a header
    line `[n] <file> (chunk <index>, score <score>)` then its content, a blank line between.

    Whole chunks are added while the total fits; the first that does not ends the context,
    except a first chunk larger than the budget, which is cut at a word boundary to fit (its
    header dropped when it leaves no room for a word of the chunk).
    """
    blocks: list[str] = []
    sources: list[ContextSource] = []
    used = 0
    for match in matches:
        header = (
            f"[{len(blocks) + 1}] {match.document_name} "
            f"(chunk {match.chunk_index}, score {match.score:.2f})"
        )
        block = f"{header}\n{match.content}"
        cost = count_tokens(block)
        if used + cost > max_tokens:
            if blocks:
                break
            room = max_tokens - count_tokens(header)
            block = f"{header}\n{first_words(match.content, room)}" if room > 0 else ""
            block = block or first_words(match.content, max_tokens)
            cost = count_tokens(block)
        blocks.append(block)
        used += cost
        sources.append(
            {
                "chunk_id": match.chunk_id,
                "document_id": match.document_id,
                "document_filename": match.document_name,
                "chunk_index": match.chunk_index,
                "score": match.score,
            }
        )
    return "\n\n".join(blocks), sources


async def _owned_base(request: Request, who: Principal, knowledge_base_id: str) -> bool:
    """Whether the caller's organization has the knowledge base."""
    return knowledge_base_id in await owned_bases(tools_of(request), who.organization_id)


router = APIRouter(responses=error_responses(404))


@router.post(
    "/knowledge-bases/search",
    summary="Search several knowledge bases",
    tags=["knowledge"],
    response_model=MultiSearch,
    openapi_extra=keyed(MULTI_SEARCH_BODY),
)
async def multi_search(request: Request, who: Principal = Who) -> Response:
    body = await body_of(request)
    check_fields(body, {"knowledge_base_ids", "query", "top_k", "min_score", "search_type"})
    ids = body.get("knowledge_base_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, str) and 0 < len(i) <= MAX_ID_CHARS for i in ids)
    ):
        raise BodyError(
            400,
            "knowledge_base_ids must be a non-empty list of ids"
            f" (at most {MAX_ID_CHARS} characters each)",
        )
    if len(ids) > MAX_SEARCH_BASES:
        raise BodyError(
            400, f"knowledge_base_ids must name at most {MAX_SEARCH_BASES} knowledge bases"
        )
    query = string_field(body, "query", required=True)
    top_k = int_field(body, "top_k", 5, 1, 50)
    min_score = score_field(body, "min_score", 0.0)
    mode = SEARCH_TYPES[search_type_field(body)]
    owned = await owned_bases(tools_of(request), who.organization_id)
    if any(i not in owned for i in ids):
        return detail(404, "Knowledge base not found")
    matches = await search_knowledge(
        tools_of(request),
        who.organization_id,
        query,
        list(dict.fromkeys(ids)),
        top_k,
        mode=mode,
        min_score=min_score,
    )
    found: MultiSearch = {
        "query": query,
        "knowledge_bases_searched": len(set(ids)),
        "top_k": top_k,
        "total_matches": len(matches),
        "matches": [match_json(m) for m in matches],
    }
    return JSONResponse(found)


@router.post(
    "/knowledge-bases/{knowledge_base_id}/search",
    summary="Search one knowledge base (semantic by default; search_type keyword or hybrid)",
    tags=["knowledge"],
    response_model=Search,
    openapi_extra=keyed(SEARCH_BODY),
)
async def search(knowledge_base_id: str, request: Request, who: Principal = Who) -> Response:
    body = await body_of(request)
    check_fields(
        body,
        {
            "query",
            "top_k",
            "min_score",
            "search_type",
            "filters",
            "include_content",
            "include_metadata",
        },
    )
    if body.get("filters"):
        raise BodyError(400, "filters are not supported")
    query = string_field(body, "query", required=True)
    top_k = int_field(body, "top_k", 5, 1, 50)
    min_score = score_field(body, "min_score", 0.0)
    mode = SEARCH_TYPES[search_type_field(body)]
    include_content = body.get("include_content", True)
    include_metadata = body.get("include_metadata", True)
    if not isinstance(include_content, bool) or not isinstance(include_metadata, bool):
        raise BodyError(400, "include_content and include_metadata must be booleans")
    if not await _owned_base(request, who, knowledge_base_id):
        return detail(404, "Knowledge base not found")
    matches = await search_knowledge(
        tools_of(request),
        who.organization_id,
        query,
        [knowledge_base_id],
        top_k,
        mode=mode,
        min_score=min_score,
    )
    found: Search = {
        "query": query,
        "knowledge_base_id": knowledge_base_id,
        "top_k": top_k,
        "total_matches": len(matches),
        "matches": [match_json(m, include_content, include_metadata) for m in matches],
    }
    return JSONResponse(found)


@router.post(
    "/knowledge-bases/{knowledge_base_id}/hybrid-search",
    summary="Hybrid search of one knowledge base (semantic and keyword scores weighted)",
    tags=["knowledge"],
    response_model=HybridSearch,
    openapi_extra=keyed(HYBRID_SEARCH_BODY),
)
async def hybrid_search(knowledge_base_id: str, request: Request, who: Principal = Who) -> Response:
    body = await body_of(request)
    check_fields(
        body, {"query", "top_k", "keyword_weight", "semantic_weight", "min_score", "filters"}
    )
    if body.get("filters"):
        raise BodyError(400, "filters are not supported")
    query = string_field(body, "query", required=True)
    top_k = int_field(body, "top_k", 5, 1, 50)
    semantic = score_field(body, "semantic_weight", 0.7)
    keyword = score_field(body, "keyword_weight", 0.3)
    if semantic == 0 and keyword == 0:
        raise BodyError(400, "semantic_weight and keyword_weight must not both be 0")
    min_score = score_field(body, "min_score", 0.0)
    if not await _owned_base(request, who, knowledge_base_id):
        return detail(404, "Knowledge base not found")
    matches = await search_knowledge(
        tools_of(request),
        who.organization_id,
        query,
        [knowledge_base_id],
        top_k,
        mode=tools_pb2.SEARCH_MODE_HYBRID,
        min_score=min_score,
        weights=(semantic, keyword),
    )
    found: HybridSearch = {
        "query": query,
        "knowledge_base_id": knowledge_base_id,
        "search_type": "hybrid",
        "weights": {"semantic": semantic, "keyword": keyword},
        "top_k": top_k,
        "total_matches": len(matches),
        "matches": [match_json(m) for m in matches],
    }
    return JSONResponse(found)


@router.post(
    "/knowledge-bases/{knowledge_base_id}/retrieve-context",
    summary="The best chunks for a query as one text within a token budget",
    tags=["knowledge"],
    response_model=Context,
    openapi_extra=keyed(CONTEXT_BODY),
)
async def retrieve_context(
    knowledge_base_id: str, request: Request, who: Principal = Who
) -> Response:
    body = await body_of(request)
    check_fields(body, {"query", "max_tokens", "top_k", "min_score"})
    query = string_field(body, "query", required=True)
    max_tokens = int_field(body, "max_tokens", 2000, 1, MAX_CONTEXT_TOKENS)
    top_k = int_field(body, "top_k", 10, 1, 50)
    min_score = score_field(body, "min_score", 0.3)
    if not await _owned_base(request, who, knowledge_base_id):
        return detail(404, "Knowledge base not found")
    matches = await search_knowledge(
        tools_of(request),
        who.organization_id,
        query,
        [knowledge_base_id],
        top_k,
        mode=tools_pb2.SEARCH_MODE_HYBRID,
        min_score=min_score,
    )
    text, sources = assemble_context(matches, max_tokens)
    answer: Context = {
        "context": text,
        "query": query,
        "sources": sources,
        "token_count": count_tokens(text),
    }
    return JSONResponse(answer)
