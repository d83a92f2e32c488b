import numpy as np
import pytest

from memlm.datastore import SimulatedCrash
from memlm.encoder import Encoder
from memlm.engine import Engine, EngineInputError
from memlm.knnlm import KnnParams

TEXT = "The harbour authority in Port Elsinore announced a new ferry timetable on Monday. " * 3


@pytest.fixture(scope="module")
def encoder():
    return Encoder.load("tiny-llama", threads=1)


@pytest.fixture
def engine(tmp_path, encoder):
    return Engine.open(
        tmp_path / "data", encoder=encoder, knn=KnnParams(k=8, temperature=1.0, lmbda=0.5)
    )


def test_fullmem_ingest_stores_every_scored_token(engine):
    n = len(engine.encoder.tokenize(TEXT))
    r = engine.process_document(7, TEXT, 19000, policy="fullmem")
    assert (r.tokens_seen, r.tokens_stored, r.first_entry, r.end_entry) == (n - 1, n - 1, 0, n - 1)
    docs, pos, days = engine.datastore.provenance(np.arange(r.end_entry))
    assert set(docs.tolist()) == {7} and set(days.tolist()) == {19000}
    assert pos.tolist() == list(range(1, n))
    assert engine.stats()["entries"] == n - 1


def test_predict_returns_neighbours_from_the_ingested_document(engine):
    before = engine.predict("The harbour authority in Port", top_n=5)
    engine.process_document(3, TEXT, 19000, policy="fullmem")
    after = engine.predict("The harbour authority in Port", top_n=5, neighbours=4)
    ids = engine.encoder.tokenize(TEXT)
    nxt = engine.encoder.token_strings([ids[5]])[0]  # " Els..." follows "Port"
    assert after.lam == 0.5 and before.lam == 0.0
    assert after.suggestions[0].token == nxt
    assert after.suggestions[0].knn_prob > 0.9
    assert after.suggestions[0].prob == pytest.approx(
        0.5 * after.suggestions[0].lm_prob + 0.5 * after.suggestions[0].knn_prob, rel=1e-5
    )
    assert after.neighbours[0].doc_id == 3 and after.neighbours[0].token == nxt
    assert after.neighbours[0].distance == pytest.approx(0.0, abs=1e-2)
    assert sum(s.prob for s in before.suggestions) <= 1.0


def test_score_and_would_store(engine):
    s = engine.score(TEXT, policy="fullmem")
    n = len(engine.encoder.tokenize(TEXT)) - 1
    assert len(s.tokens) == len(s.logprobs) == len(s.lm_logprobs) == n and all(s.would_store)
    assert s.ppl == pytest.approx(s.lm_ppl)  # empty memory: the augmented model is the LM
    engine.process_document(1, TEXT, 19000, policy="fullmem")
    s2 = engine.score(TEXT, policy="monim")
    assert s2.ppl < s.lm_ppl / 2  # the memory holds this very text
    assert sum(s2.would_store) < n


def test_crash_after_append_and_truncate(engine):
    with pytest.raises(SimulatedCrash):
        engine.process_document(9, TEXT, 19000, policy="fullmem", crash_at="after_append")
    assert len(engine.datastore) > 0
    engine.truncate_datastore(0)
    assert engine.stats()["datastore_entries"] == 0
    assert engine.predict("The harbour").neighbours == []


def test_rebuild_and_forget(engine):
    engine.process_document(1, TEXT, 19000, policy="fullmem")
    engine.process_document(
        2, "A completely different story about mountains.", 19001, policy="fullmem"
    )
    info = engine.rebuild()
    assert info.version == 1 and engine.stats()["index_version"] == 1
    total = engine.stats()["entries"]
    removed = engine.forget_document(1)
    assert removed == len(engine.encoder.tokenize(TEXT)) - 1
    assert engine.stats()["entries"] == total - removed
    p = engine.predict("The harbour authority in Port", neighbours=5)
    assert all(nb.doc_id == 2 for nb in p.neighbours)


def test_bad_input(engine):
    with pytest.raises(EngineInputError):
        engine.score("a")
    with pytest.raises(EngineInputError):
        engine.predict("")


def test_readonly_engine_follows_the_writer(tmp_path, encoder):
    knn = KnnParams(k=8, temperature=1.0, lmbda=0.5)
    writer = Engine.open(tmp_path / "data", encoder=encoder, knn=knn)
    reader = Engine.open(tmp_path / "data", encoder=encoder, knn=knn, readonly=True)
    r = writer.process_document(4, TEXT, 19000, policy="fullmem")
    assert reader.stats()["entries"] == 0
    assert reader.sync() == r.tokens_stored
    assert reader.stats()["entries"] == r.tokens_stored
    assert reader.predict("The harbour authority in Port", neighbours=1).neighbours[0].doc_id == 4
    with pytest.raises(RuntimeError, match="read-only"):
        reader.process_document(5, TEXT, 19000)
    writer.rebuild()
    assert reader.reload_index() and reader.stats()["index_version"] == 1


def test_predict_batch_equals_single_predicts(engine):
    engine.process_document(1, TEXT, 19000, policy="fullmem")
    contexts = ["The harbour authority in Port", "A new ferry", "Monday"]
    batch = engine.predict_batch(contexts, top_n=4, neighbours=2)
    for ctx, b in zip(contexts, batch, strict=True):
        one = engine.predict(ctx, top_n=4, neighbours=2)
        assert [s.token_id for s in b.suggestions] == [s.token_id for s in one.suggestions]
        for x, y in zip(b.suggestions, one.suggestions, strict=True):
            assert x.prob == pytest.approx(y.prob, rel=1e-4, abs=1e-7)
        assert [n.entry_id for n in b.neighbours] == [n.entry_id for n in one.neighbours]
        assert b.lam == one.lam and b.context_tokens == one.context_tokens
