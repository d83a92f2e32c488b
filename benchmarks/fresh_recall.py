"""Does the served memory answer with what it knows?  Fresh recall, paraphrases, unrelated text.

A service as ``memlm up`` opens it (the settings' defaults: MoNIM, held-out recording, the
evidence interpolation) memorises some days of the bundled news and then a set of
articles that are not in it; then, before any build and again after the first rebuild:

- **fresh recall**: ``predict`` along each ingested article, at every word position (the
  next token starts a word), as a user asks ``/predict`` with the article's prefix; the
  share of positions whose next token is ranked first;
- **paraphrase**: the perplexity of a text stating the same facts in other words, never
  ingested, against the LM alone;
- **unrelated**: the perplexity of texts unrelated to the memory, against the LM alone.

The same memory is also read, side by side, by an engine that serves what memlm served
before the evidence interpolation (the constant: lambda 0.005 until a build tunes it on
the held-out tokens), so both columns come from one run.

    MEMLM_THREADS=2 python benchmarks/fresh_recall.py
    MEMLM_THREADS=2 python benchmarks/fresh_recall.py --articles my_articles.json --news-days 3

``--articles``: a JSON file like benchmarks/data/fresh_articles.json (articles with
``text`` and ``paraphrase``, and ``unrelated`` texts).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from _common import load_average, markdown_table, open_served_engine, stopwatch

HERE = Path(__file__).resolve().parent


def word_positions(engine: Any, text: str) -> tuple[list[str], list[int], list[int]]:
    """Contexts ending just before each word after the first, that word's first token, and
    its token index."""
    ids = engine.encoder.tokenize(text)
    spans = engine.encoder.char_offsets(text)
    strings = engine.encoder.token_strings(ids)
    contexts, gold, where = [], [], []
    for i in range(1, len(ids)):
        if strings[i].startswith(" ") and spans[i][0] > 0:
            contexts.append(text[: spans[i][0]])
            gold.append(ids[i])
            where.append(i)
    return contexts, gold, where


def recall(engine: Any, texts: list[str], batch: int = 16) -> tuple[float, float, int]:
    """(top-1 share under the served model, under the LM alone, positions)."""
    hits = lm_hits = n = 0
    for text in texts:
        contexts, gold, where = word_positions(engine, text)
        ids = engine.encoder.tokenize(text)
        lm_top = engine.encoder.encode_ids(ids, engine.window).top_id  # [j] predicts ids[j+1]
        for i in range(0, len(contexts), batch):
            preds = engine.predict_batch(contexts[i : i + batch], top_n=1)
            for p, g in zip(preds, gold[i : i + batch], strict=True):
                hits += p.suggestions[0].token_id == g
                n += 1
        lm_hits += sum(int(lm_top[j - 1] == ids[j]) for j in where)
    return hits / n, lm_hits / n, n


def ppl_ratio(engine: Any, texts: list[str]) -> tuple[float, float]:
    """(served ppl / LM ppl over all tokens of ``texts``, the LM ppl)."""
    lm, aug = [], []
    for t in texts:
        r = engine.score(t)
        lm += r.lm_logprobs
        aug += r.logprobs
    lm_ppl = math.exp(-float(np.mean(lm)))
    return math.exp(-float(np.mean(aug))) / lm_ppl, lm_ppl


def measure(engines: dict[str, Any], data: dict[str, Any]) -> dict[str, dict[str, float]]:
    texts = [a["text"] for a in data["articles"]]
    paraphrases = [a["paraphrase"] for a in data["articles"]]
    out: dict[str, dict[str, float]] = {}
    for name, eng in engines.items():
        eng.reload_index()
        served, lm, n = recall(eng, texts)
        para, para_lm = ppl_ratio(eng, paraphrases)
        unrel, unrel_lm = ppl_ratio(eng, data["unrelated"])
        out[name] = {
            "recall": served,
            "lm_recall": lm,
            "positions": n,
            "paraphrase": para,
            "unrelated": unrel,
            "lambda_source": eng.served.lambda_source,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--articles", type=Path, default=HERE / "data" / "fresh_articles.json")
    ap.add_argument("--start", default="2017-02-13", help="first news day memorised")
    ap.add_argument("--news-days", type=int, default=2)
    ap.add_argument("--per-day", type=int, default=12, help="news articles a day")
    ap.add_argument("--policy", default="monim")
    args = ap.parse_args()

    from _common import memorise, rebuild

    from memlm.calibrator.constant import SERVED_DEFAULT, SERVED_GRID
    from memlm.corpus import Document, by_day, load_news
    from memlm.engine import Engine

    data = json.loads(args.articles.read_text())
    start = dt.date.fromisoformat(args.start)
    news = [d for day, docs in by_day(load_news()) if day >= start for d in docs[: args.per_day]]
    days = sorted({d.published_at for d in news})[: args.news_days]
    news = [d for d in news if d.published_at in days]
    fresh_day = max(days) + dt.timedelta(days=1)
    fresh = [
        Document(a["id"], a["text"], fresh_day, "fresh.example", a.get("title", ""))
        for a in data["articles"]
    ]
    print(f"load average before: {load_average()}")
    settings, engine, _ = open_served_engine("fresh-recall", policy=args.policy)
    with stopwatch() as t:
        memorise(engine, settings, [*news, *fresh], build=False)
    print(
        f"memorised {len(news)} news articles ({len(days)} days) and {len(fresh)} new ones "
        f"in {t.seconds:.0f} s: {engine.memory.count()} entries, policy {args.policy}"
    )
    before = Engine.open(
        settings.datastore_dir,
        encoder=engine.encoder,
        knn=SERVED_DEFAULT,
        grid=SERVED_GRID,
        readonly=True,
        evidence=False,
    )
    engines = {"evidence (now)": engine, "constant (before)": before}
    results = {"before any build": measure(engines, data)}
    with stopwatch() as t:
        rebuild(engine, settings)
    print(f"first rebuild: {t.seconds:.0f} s, index version {engine.served_version}")
    # whether the NN calibrator joined the evidence at this build, and why (not)
    combined = (engine.served.record.get("evidence") or {}).get("combined") or {}
    print(
        f"the build's held-out tokens: {engine.served.record.get('tokens', 0)}; "
        f"the combination with the calibrator serves: {combined.get('serve', False)} "
        f"({combined.get('reason') or 'it wins in each view'})"
    )
    results["after the first rebuild"] = measure(engines, data)

    rows = []
    for when, res in results.items():
        for name, r in res.items():
            rows.append(
                (
                    when,
                    name,
                    r["lambda_source"],
                    f"{r['recall']:.1%}",
                    f"{r['lm_recall']:.1%}",
                    int(r["positions"]),
                    f"{r['paraphrase'] - 1:+.1%}",
                    f"{r['unrelated'] - 1:+.2%}",
                )
            )
    print()
    print(
        markdown_table(
            [
                "when",
                "interpolation",
                "lambda from",
                "fresh recall (top-1)",
                "LM alone",
                "positions",
                "paraphrase ppl vs LM",
                "unrelated ppl vs LM",
            ],
            rows,
        )
    )
    print(f"\nload average after: {load_average()}")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
