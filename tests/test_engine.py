import numpy as np
import pytest

from memlm.calibrator.lexical import LexicalStats
from memlm.datastore import SimulatedCrash
from memlm.encoder import Encoder, WindowConfig
from memlm.engine import Engine, EngineInputError
from memlm.knnlm import KnnParams, MemoryOptions
from memlm.memory.pointers import PointerConfig

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
    docs, pos, days = engine.memory.datastore.provenance(np.arange(r.end_entry))
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
    assert len(engine.memory.datastore) > 0
    engine.memory.truncate(0)
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
    removed = engine.forget_document(1, TEXT)
    assert removed == len(engine.encoder.tokenize(TEXT)) - 1
    assert engine.stats()["entries"] == total - removed
    # its tokens left the lexical statistics too, on disk, and a retry takes nothing twice
    only_2 = LexicalStats(engine.encoder.vocab_size)
    only_2.update(
        np.array(engine.encoder.tokenize("A completely different story about mountains."))
    )
    assert engine.forget_document(1, TEXT) == 0
    on_disk = LexicalStats.load(engine.calibration.lexical_path, engine.encoder.vocab_size)
    for lex in (engine.calibration.lexical, on_disk):
        assert np.array_equal(lex.count, only_2.count)
        assert np.array_equal(lex.successors, only_2.successors)
        assert lex.docs == {2} and lex.forgotten == {1}
    p = engine.predict("The harbour authority in Port", neighbours=5)
    assert all(nb.doc_id == 2 for nb in p.neighbours)


def test_nightly_builds_are_incremental_and_forget_needs_no_build(engine):
    """The second build adds to the first; a forgotten document leaves every search at
    once (no build) and the next build removes its ids from the copy it writes."""
    engine.process_document(1, TEXT, 19000, policy="fullmem")
    first = engine.rebuild()
    assert (first.mode, first.reason) == ("full", "first build")
    other = "A completely different story about mountains."
    engine.process_document(2, other, 19001, policy="fullmem")
    removed = engine.forget_document(1, TEXT)
    p = engine.predict("The harbour authority in Port", neighbours=5)
    assert p.neighbours and all(nb.doc_id == 2 for nb in p.neighbours)  # before any build
    second = engine.rebuild()
    assert (second.mode, second.base_version, second.removed) == ("incremental", 1, removed)
    assert second.added == len(engine.encoder.tokenize(other)) - 1
    assert second.entries == engine.stats()["entries"]
    forced = engine.rebuild(retrain=True)
    assert (forced.mode, forced.reason, forced.entries) == (
        "full",
        "retrain requested",
        second.entries,
    )
    assert forced.record()["mode"] == "full"


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


# --- TRIME local / long-term memory in score and predict ------------------------------------


def _eq6(engine, ids, tau):
    """Eq. 6 by hand, float64: (n, V) log-probs of every position of one window."""
    keys, hidden, _ = engine.encoder.start([ids])
    k = keys[0].double().numpy()  # (n, d): row t keys the context ids[:t + 1]
    logits = engine.encoder.logits(hidden[0]).double().numpy()  # (n, V)
    out = np.empty_like(logits)
    for t in range(len(ids)):
        mass = np.exp(logits[t])
        for j in range(t):  # entry j: key of ids[:j + 1], value ids[j + 1]
            mass[ids[j + 1]] += np.exp(k[t] @ k[j] / np.sqrt(k.shape[1]) / tau)
        out[t] = np.log(mass / mass.sum())
    return out


def test_score_with_local_memory_is_trime_eq6_then_the_datastore(engine):
    text = "Port Elsinore ferry, Port Elsinore ferry, Port Elsinore ferry."
    ids = engine.encoder.tokenize(text)
    mem = MemoryOptions(local=True, tau=0.7)
    empty = engine.score(text, memory=mem)
    expected = _eq6(engine, ids, 0.7)[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(empty.trime_logprobs, expected, rtol=1e-4)
    assert empty.trime_logprobs[0] == pytest.approx(empty.lm_logprobs[0], rel=1e-5)  # no memory yet
    assert empty.ppl == pytest.approx(empty.trime_ppl) and empty.trime_ppl < empty.lm_ppl
    assert engine.score(text).trime_logprobs is None
    # with a datastore the kNN part is interpolated on top of Eq. 6 (lambda 0.5)
    engine.process_document(1, TEXT, 19000, policy="fullmem")
    plain, both = engine.score(text), engine.score(text, memory=mem)
    p_knn = 2 * np.exp(plain.logprobs) - np.exp(plain.lm_logprobs)
    np.testing.assert_allclose(
        both.logprobs, np.log(0.5 * np.exp(both.trime_logprobs) + 0.5 * p_knn), rtol=1e-4
    )


def test_predict_with_local_memory(engine):
    ctx = "Port Elsinore ferry, Port Elsinore ferry, Port"
    ids = engine.encoder.tokenize(ctx)
    engine.process_document(1, TEXT, 19000, policy="fullmem")
    pred = engine.predict(ctx, top_n=5, memory=MemoryOptions(local=True, tau=0.7))
    expected = np.exp(_eq6(engine, ids, 0.7)[-1])
    for s in pred.suggestions:
        assert s.trime_prob == pytest.approx(expected[s.token_id], rel=1e-4)
        assert s.prob == pytest.approx(0.5 * s.trime_prob + 0.5 * s.knn_prob, rel=1e-5)
    assert engine.predict(ctx, top_n=5).suggestions[0].trime_prob is None


def test_long_term_memory_reaches_before_the_window(tmp_path, encoder):
    eng = Engine.open(tmp_path / "d", encoder=encoder, window=WindowConfig(context=8, stride=4))
    text = "Port Elsinore ferry timetable, " * 6
    ids = eng.encoder.tokenize(text)
    local = eng.score(text, memory=MemoryOptions(local=True, tau=0.7)).trime_logprobs
    long = eng.score(text, memory=MemoryOptions(long_segments=1, tau=0.7)).trime_logprobs
    assert local[:7] == pytest.approx(long[:7])  # the first window has nothing before it
    assert not np.allclose(local[8:], long[8:])
    # predict: the window's own 7 earlier positions, plus the 8 before it
    keys, _, _ = eng.encoder.start([ids[-8:]])
    keys_l, values = eng._context_memory(ids, keys[0, :7], ids[-8:], MemoryOptions(long_segments=1))
    begin = len(ids) - 8
    before = eng.encoder.encode_ids(ids[: begin + 1], eng.window)
    assert values.tolist() == before.targets[-8:].tolist() + ids[-7:]
    np.testing.assert_allclose(keys_l[:8].numpy(), before.keys[-8:], rtol=1e-5)
    keys_s, values_s = eng._context_memory(ids, keys[0, :7], ids[-8:], MemoryOptions(local=True))
    assert values_s.tolist() == ids[-7:] and keys_s.shape == (7, eng.encoder.dim)


def test_fit_context_keeps_exactly_what_predict_reads(tmp_path, encoder):
    engine = Engine.open(tmp_path / "data", encoder=encoder, window=WindowConfig(16, 8))
    ids = encoder.tokenize(TEXT)
    assert engine.predict_span() == 16 and engine.predict_span(2) == 48
    assert engine.count_tokens(TEXT) == len(ids) > 48
    fit = engine.fit_context(TEXT)
    assert (fit.tokens, fit.total) == (16, len(ids)) and TEXT.endswith(fit.text)
    assert encoder.tokenize(fit.text) == ids[-16:]
    full, cut = engine.predict(TEXT, top_n=5), engine.predict(fit.text, top_n=5)
    assert [s.token_id for s in full.suggestions] == [s.token_id for s in cut.suggestions]
    assert [s.prob for s in full.suggestions] == [s.prob for s in cut.suggestions]
    fit = engine.fit_context(TEXT, long_segments=2)
    assert fit.tokens == 48 and encoder.tokenize(fit.text) == ids[-48:]
    short = "The harbour authority"
    n = len(encoder.tokenize(short))
    assert engine.fit_context(short) == type(fit)(short, n, n)


def test_randmem_masks_are_per_document_and_repeat_on_reprocessing(engine):
    from memlm.knnlm.policy import RandMem

    pol = RandMem(0.3, seed=11)
    first = engine.prepare_document(21, TEXT, 19000, policy=pol)
    other = engine.prepare_document(22, TEXT, 19000, policy=pol)
    again = engine.prepare_document(21, TEXT, 19000, policy=RandMem(0.3, seed=11))
    n = len(first.store)
    # same text, different documents: different masks; the same document: the same one
    assert not np.array_equal(first.store, other.store)
    assert np.array_equal(first.store, again.store)
    assert np.array_equal(first.store, np.random.default_rng([11, 21]).random(n) < 0.3)
    r = engine.store_document(first)
    docs, pos, _ = engine.memory.datastore.provenance(np.arange(r.end_entry))
    assert r.tokens_stored == int(first.store.sum()) and set(docs.tolist()) == {21}
    assert pos.tolist() == (first.outputs.positions[first.store]).tolist()


def test_entries_appended_during_a_build_are_all_searchable_after_it(engine, monkeypatch):
    """The build works on a snapshot; what ingest appends meanwhile joins the fresh index
    that the new version is served with."""
    import threading

    import memlm.index.build as index_mod

    engine.process_document(1, TEXT, 19000, policy="fullmem")
    n0 = len(engine.memory.datastore)
    snapshot_taken, resume = threading.Event(), threading.Event()
    real_live_ids = index_mod._live_ids

    def paused(ds, upto):  # build_index calls it right after taking its snapshot
        snapshot_taken.set()
        assert resume.wait(60)
        return real_live_ids(ds, upto)

    monkeypatch.setattr(index_mod, "_live_ids", paused)
    infos = []
    builder = threading.Thread(target=lambda: infos.append(engine.rebuild()))
    builder.start()
    assert snapshot_taken.wait(60)
    others = [
        "Mountain villages reported heavy snow across the northern passes overnight.",
        "The central bank kept its rates unchanged and signalled patience on inflation.",
        "A new exhibition of early photographs opened at the city museum on Friday.",
    ]
    for i, text in enumerate(others, start=2):
        engine.process_document(i, text, 19001, policy="fullmem")  # ingest during the build
    total = len(engine.memory.datastore)
    resume.set()
    builder.join(60)
    assert not builder.is_alive() and infos[0].upto == n0 < total
    idx = engine.stats()["index"]
    assert (engine.memory.index.version, idx["built_entries"], idx["fresh_entries"]) == (
        1,
        n0,
        total - n0,
    )
    ids = np.arange(total)
    keys = engine.memory.datastore.keys(ids).astype(np.float32)
    dist, found = engine.memory.index.search(keys, 4)
    assert (found == ids[:, None]).any(axis=1).all()  # every entry finds itself
    docs, _, _ = engine.memory.datastore.provenance(ids[n0:])
    assert set(docs.tolist()) == {2, 3, 4}


def test_monim_decides_with_the_served_interpolation(tmp_path, encoder):
    """Ingest scoring asks the model served now: once a build serves lambda 0, MoNIM
    decides exactly as it would with the bare LM (and /score agrees with it)."""
    from memlm.calibrator.constant import TuneGrid

    eng = Engine.open(
        tmp_path / "data",
        encoder=encoder,
        knn=KnnParams(k=8, temperature=1.0, lmbda=0.5),  # served until a build chooses
        grid=TuneGrid(ks=(8,), temperatures=(1.0,), lambdas=(0.0,)),  # what builds choose
    )
    eng.process_document(1, TEXT, 19000, policy="fullmem")
    out = encoder.encode_ids(encoder.tokenize(TEXT))
    bare = out.target_logprob < -1.5  # MoNIM's rule on the bare LM
    before = eng.prepare_document(2, TEXT, 19001, policy="monim").store
    assert bare.sum() == len(bare) and before.sum() < len(before)  # lambda 0.5 matters
    info = eng.rebuild()
    assert (info.interpolation["lambda"], info.interpolation["source"]) == (0.0, "fixed")
    assert eng.knn == KnnParams(k=8, temperature=1.0, lmbda=0.0)
    after = eng.prepare_document(2, TEXT, 19001, policy="monim").store
    np.testing.assert_array_equal(after, bare)
    sc = eng.score(TEXT, policy="monim")
    assert sc.would_store == bare.tolist()
    np.testing.assert_array_equal(sc.logprobs, sc.lm_logprobs)
    st = eng.stats()["interpolation"]
    assert (st["k"], st["temperature"], st["lambda"]) == (8, 1.0, 0.0)
    assert (st["source"], st["lambda_source"], st["chosen_for"]) == ("fixed", "constant", 1)


def test_the_engines_rerank_depth_reaches_every_memory_search(tmp_path, encoder, monkeypatch):
    eng = Engine.open(
        tmp_path / "data", encoder=encoder, knn=KnnParams(k=8, temperature=1.0, lmbda=0.5),
        rerank_depth=96,
    )  # fmt: skip
    depths = []
    search = eng.memory.search

    def spy(queries, k, *, depth=None):
        depths.append(depth)
        return search(queries, k, depth=depth)

    monkeypatch.setattr(eng.memory, "search", spy)
    eng.process_document(1, TEXT, 19000, policy="monim")
    eng.score(TEXT, policy="monim")
    eng.predict("The harbour authority in Port", top_n=3)
    assert len(depths) >= 3 and set(depths) == {96}
    with pytest.raises(ValueError, match="rerank_depth"):
        Engine.open(tmp_path / "other", encoder=encoder, rerank_depth=0)


def test_the_ingest_rerank_depth_serves_the_decision_alone(tmp_path, encoder, monkeypatch):
    """``ingest_rerank_depth`` re-ranks MoNIM's decision while ingesting; /score, /predict
    and the held-out records (they tune what is served) keep the served depth."""
    from memlm.calibrator.heldout import HeldOutConfig

    eng = Engine.open(
        tmp_path / "data", encoder=encoder, knn=KnnParams(k=8, temperature=1.0, lmbda=0.5),
        rerank_depth=96, ingest_rerank_depth=48,
        heldout=HeldOutConfig(enabled=True, share=1.0),
    )  # fmt: skip
    assert eng.ingest_rerank_depth == 48
    calls: list[tuple[int, int | None]] = []
    search = eng.memory.search

    def spy(queries, k, *, depth=None):
        calls.append((len(queries), depth))
        return search(queries, k, depth=depth)

    monkeypatch.setattr(eng.memory, "search", spy)
    eng.process_document(1, TEXT, 19000, policy="fullmem")
    calls.clear()
    prep = eng.prepare_document(2, TEXT, 19000, policy="monim")
    assert calls[0] == (len(prep.outputs), 48)  # the decision, every token
    assert [d for _, d in calls[1:]] == [96]  # the held-out record: its own search
    calls.clear()
    eng.score(TEXT, policy="monim")
    eng.predict("The harbour authority in Port", top_n=3)
    assert calls and {d for _, d in calls} == {96}
    # None: the served depth for every search
    same = Engine.open(
        tmp_path / "same", encoder=encoder, knn=KnnParams(k=8, temperature=1.0, lmbda=0.5),
        rerank_depth=96, heldout=HeldOutConfig(enabled=True, share=1.0),
    )  # fmt: skip
    assert same.ingest_rerank_depth == 96
    same.process_document(1, TEXT, 19000, policy="fullmem")
    monkeypatch.setattr(same.memory, "search", spy)
    calls.clear()
    same.prepare_document(2, TEXT, 19000, policy="monim")
    assert calls and {d for _, d in calls} == {96}
    with pytest.raises(ValueError, match="ingest_rerank_depth"):
        Engine.open(tmp_path / "other", encoder=encoder, ingest_rerank_depth=0)


def test_engine_pointers_follow_the_text_the_memory_holds(tmp_path, encoder):
    eng = Engine.open(
        tmp_path / "data", encoder=encoder, knn=KnnParams(k=8, temperature=1.0, lmbda=0.5),
        pointers=PointerConfig(min_hits=2, slack=2.0),
    )  # fmt: skip
    full = Engine.open(
        tmp_path / "data", encoder=encoder, knn=KnnParams(k=8, temperature=1.0, lmbda=0.5),
        readonly=True,
    )  # fmt: skip
    for doc in range(3):
        eng.process_document(doc, TEXT, 19000, policy="fullmem")
    full.sync()
    assert eng._follow == {}  # FullMem stores without searching
    s = eng.score(TEXT, policy="fullmem")
    ps = eng._follow[(8, None)]
    n = len(s.tokens)
    assert ps.stats.tokens == n
    assert ps.stats.followed > n // 2  # the memory holds this text three times
    assert ps.stats.searched == n - ps.stats.followed
    assert s.ppl == pytest.approx(full.score(TEXT, policy="fullmem").ppl, rel=0.05)


def test_encode_ahead_gives_what_encoding_in_place_gives(engine, monkeypatch):
    import threading

    other = "A storm closed the ferry line to the islands for two days last week. " * 2
    engine.process_document(1, TEXT, 19000, policy="fullmem")
    in_place = engine.prepare_document(2, other, 19000, policy="monim")
    threads = []
    encode = engine._encode

    def spy(text, key_ce=False):
        threads.append(threading.current_thread().name)
        return encode(text, key_ce)

    monkeypatch.setattr(engine, "_encode", spy)
    engine.encode_ahead(other, policy="monim")
    ahead = engine.prepare_document(2, other, 19000, policy="monim")
    assert len(threads) == 1 and threads[0].startswith("encode-ahead")
    np.testing.assert_array_equal(ahead.store, in_place.store)
    np.testing.assert_array_equal(ahead.outputs.keys, in_place.outputs.keys)
    engine.encode_ahead(TEXT, policy="monim")  # not taken: the next document is another
    engine._ahead[1].result()
    engine.prepare_document(3, other, 19000, policy="monim")
    assert [t.startswith("encode-ahead") for t in threads[1:]] == [True, False]


def test_prepare_document_encodes_the_next_text_once_its_own_is_encoded(engine, monkeypatch):
    import threading

    other = "A storm closed the ferry line to the islands for two days last week. " * 2
    engine.process_document(1, TEXT, 19000, policy="fullmem")
    in_place = [
        engine.prepare_document(d, t, 19000, policy="monim") for d, t in [(2, TEXT), (3, other)]
    ]
    calls = []  # (on the encode-ahead thread, text, another encode running at its start)
    active = [0]
    lock = threading.Lock()
    encode = engine._encode

    def spy(text, key_ce=False):
        with lock:
            active[0] += 1
            ahead = threading.current_thread().name.startswith("encode-ahead")
            calls.append((ahead, text, active[0] > 1))
        try:
            return encode(text, key_ce)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(engine, "_encode", spy)
    first = engine.prepare_document(2, TEXT, 19000, policy="monim", next_text=other)
    second = engine.prepare_document(3, other, 19000, policy="monim")
    # this document encoded here, then the next one ahead (never two at once), taken by
    # the next prepare
    assert calls == [(False, TEXT, False), (True, other, False)]
    for got, want in zip([first, second], in_place, strict=True):
        np.testing.assert_array_equal(got.store, want.store)
        np.testing.assert_array_equal(got.outputs.keys, want.outputs.keys)


def test_two_workers_of_one_engine_take_only_their_own_encodes_ahead(engine):
    """Two ingest threads of one engine, each preparing its documents with the next one's
    text as ``next_text``: every prepared document holds its own text's outputs (the
    oracle: each text encoded alone), whichever thread started its encode (one slot: the
    two threads' encodes ahead replace each other, and a prepare leaves the other's be)."""
    import threading

    words = ["harbour", "ferry", "storm", "council", "bridge", "market", "river", "school"]
    texts = [
        f"The {w} report number {i} was read out {i % 3 + 1} times at the {w} meeting. "
        * (1 + i % 3)
        for i, w in enumerate(words * 2)
    ]
    oracle = {t: engine._encode(t, False)[1] for t in texts}
    queues = [texts[0::2], texts[1::2]]
    got: dict[str, object] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(mine: list[str], first_doc: int) -> None:
        try:
            start.wait()
            for j, t in enumerate(mine):
                nxt = mine[j + 1] if j + 1 < len(mine) else None
                prep = engine.prepare_document(
                    first_doc + j, t, 19000, policy="monim", next_text=nxt
                )
                got[t] = prep.outputs
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(q, 100 * (i + 1))) for i, q in enumerate(queues)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert set(got) == set(texts)
    for t in texts:
        np.testing.assert_array_equal(got[t].keys, oracle[t].keys)
        np.testing.assert_array_equal(got[t].targets, oracle[t].targets)


def test_the_engines_faiss_searches_use_the_models_threads(tmp_path, encoder):
    """MEMLM_THREADS bounds the model's threads and the memory's searches alike."""
    eng = Engine.open(tmp_path / "data", encoder=encoder)
    assert eng.memory.threads == encoder.threads
