"""Knowledge search quality on the labelled set (tests/tools/knowledge_eval/): recall@5 and
MRR@10 of each mode must stay above their floors, and hybrid must find at least what keyword
search finds.

The floors sit about 0.05 under what was measured (docs/knowledge.md, "Measured quality"): a
change to chunking, scoring or the model that costs more than that fails here. Runs on the
backend under test: SQLite, or a fresh PostgreSQL database with LOOPLINE_TEST_BACKEND=postgres.
The corpus is indexed once for the module (the local model embeds ~180 chunks).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from services.common import db
from services.tools import knowledge_eval
from services.tools.chunking import chunk_text
from services.tools.knowledge_eval import Evaluation, normalise
from tests.conftest import postgres_databases, release_databases, selected_backend

# mode: (recall@5, MRR@10) floors, 0.05 under the lower of SQLite's and PostgreSQL's figures:
# keyword 0.605 / 0.426 and 0.566 / 0.430, semantic 0.803 / 0.571 on both, hybrid 0.855 / 0.679
# and 0.842 / 0.672
FLOORS = {
    "keyword": (0.51, 0.37),
    "semantic": (0.75, 0.52),
    "hybrid": (0.79, 0.62),
}


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory: pytest.TempPathFactory) -> Evaluation:
    """The evaluation of every mode on a fresh, migrated tools database (run once)."""

    async def run() -> Evaluation:
        urls = None
        if selected_backend() == "postgres":
            urls = await postgres_databases()
            url = urls["tools"]
        else:
            url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('quality') / 'tools.db'}"
            await db.migrate_async("tools", url)
        try:
            return await knowledge_eval.evaluate_database(url)
        finally:
            if urls is not None:
                release_databases(list(urls.values()))

    return asyncio.run(run())


def test_every_label_is_one_phrase_of_its_document_found_whole_in_a_chunk():
    questions = knowledge_eval.load_questions()
    corpus = knowledge_eval.load_corpus()
    assert 60 <= len(questions) <= 80
    assert len({q.question for q in questions}) == len(questions)
    assert set(Counter(q.kind for q in questions)) == {"paraphrase", "low_overlap", "exact"}
    chunks = {name: [normalise(c) for c in chunk_text(text)] for name, text in corpus.items()}
    for q in questions:
        phrase = normalise(q.answer)
        assert 4 <= len(phrase.split()) <= 13, q
        assert normalise(corpus[q.document]).count(phrase) == 1, q
        assert any(phrase in chunk for chunk in chunks[q.document]), q


def test_every_document_is_indexed_and_every_question_asked(evaluation):
    assert evaluation.documents == 10
    assert evaluation.chunks >= evaluation.documents
    for mode in knowledge_eval.MODES:
        assert len(evaluation.results[mode].ranks) == len(evaluation.questions)


@pytest.mark.parametrize("mode", list(FLOORS))
def test_each_mode_stays_above_its_floor(evaluation, mode):
    result = evaluation.results[mode]
    recall_floor, mrr_floor = FLOORS[mode]
    shown = knowledge_eval.report(evaluation)
    assert result.recall >= recall_floor, shown
    assert result.mrr >= mrr_floor, shown


def test_hybrid_finds_at_least_what_keyword_search_finds(evaluation):
    hybrid, keyword = evaluation.results["hybrid"], evaluation.results["keyword"]
    assert hybrid.recall >= keyword.recall
    assert hybrid.mrr >= keyword.mrr
    # meaning is what keyword search lacks: the questions that share no words with the passage
    low = [i for i, q in enumerate(evaluation.questions) if q.kind == "low_overlap"]
    found = {
        mode: sum(1 for i in low if (r := evaluation.results[mode].ranks[i]) and r <= 5)
        for mode in ("keyword", "hybrid")
    }
    assert found["hybrid"] > found["keyword"], found
