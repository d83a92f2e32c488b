"""Where the evidence prior comes from: the best lambda by relative distance and agreement.

Memorises 12 articles a day of three days of the bundled news (MoNIM, the served default
interpolation) and the invented articles of benchmarks/data/fresh_articles.json, then
searches the memory (k 64) with the tokens of five kinds of text:

- ``reread_fresh`` / ``reread_news``: articles the memory holds, asked again;
- ``paraphrase``: the invented articles told in other words (never ingested);
- ``heldout``: other articles of the same days (never ingested);
- ``unrelated``: texts about other things.

Per bin of relative distance rho = d_1 / |q|^2 (s = sqrt(rho)) and agreement (the kNN
share of the nearest neighbour's value, T 2) it prints the lambda with the lowest NLL
among a grid, and then the perplexity of each kind of text against the LM under the
constant lambda 0.005 (what memlm served before), the prior (memlm.calibrator.evidence.PRIOR),
and the prior refitted on held-out and re-read tokens as a build would.

    MEMLM_THREADS=2 python benchmarks/evidence_prior.py
"""

from __future__ import annotations

import datetime as dt
import json
import tempfile
from pathlib import Path

import numpy as np
from _common import load_average, markdown_table, stopwatch

HERE = Path(__file__).resolve().parent
T = 2.0
LAMBDAS = np.array([0, 1e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.97, 0.99])


def search(engine, texts):  # noqa: ANN001, ANN201 - a script
    parts = []
    for text in texts:
        o = engine.encoder.encode_ids(engine.encoder.tokenize(text), engine.window)
        dist, _, vals = engine.memory.search(o.keys, 64)
        parts.append(
            {
                "distances": dist,
                "values": vals,
                "gold": o.targets,
                "target_lm_logprob": o.target_logprob.astype(np.float64),
                "qnorm": (o.keys.astype(np.float64) ** 2).sum(axis=1),
                "context": o.positions.astype(np.float64),
            }
        )
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def main() -> None:
    from memlm.calibrator import evidence
    from memlm.calibrator.evidence import PRIOR, features
    from memlm.corpus import by_day, load_news
    from memlm.engine import Engine
    from memlm.knnlm import KnnParams, interpolate, knn_logprob

    fresh = json.loads((HERE / "data" / "fresh_articles.json").read_text())
    days = [(d, docs) for d, docs in by_day(load_news()) if d >= dt.date(2017, 2, 13)][:3]
    print(f"load average before: {load_average()}")
    eng = Engine.open(Path(tempfile.mkdtemp()), knn=KnnParams(64, T, 0.005))
    ingested, heldout = [], []
    doc = 0
    with stopwatch() as t:
        for _, docs in days:
            for d in docs[:12]:
                doc += 1
                eng.process_document(doc, d.text, 17000)
                ingested.append(d.text)
            heldout += [d.text for d in docs[12:16]]
        for a in fresh["articles"]:
            doc += 1
            eng.process_document(doc, a["text"], 17000)
    print(f"memorised {doc} articles in {t.seconds:.0f} s: {eng.memory.count()} entries")
    groups = {
        "reread_fresh": search(eng, [a["text"] for a in fresh["articles"]]),
        "reread_news": search(eng, ingested[:4]),
        "paraphrase": search(eng, [a["paraphrase"] for a in fresh["articles"]]),
        "heldout": search(eng, heldout[:6]),
        "unrelated": search(eng, fresh["unrelated"]),
    }
    rows = []
    for g, z in groups.items():
        d, v, gold, lm = z["distances"], z["values"], z["gold"], z["target_lm_logprob"]
        knn = knn_logprob(d, np.where(v >= 0, 0, -1), v, gold[:, None], T)[:, 0]
        s, agree = features(d, v, z["qnorm"], T)
        for lo, hi in [(0, 0.03), (0.03, 0.2), (0.2, 0.3), (0.3, 0.4), (0.4, 0.5), (0.5, 9)]:
            for alo, ahi in [(0, 0.5), (0.5, 0.9), (0.9, 1.01)]:
                m = (s >= lo) & (s < hi) & (agree >= alo) & (agree < ahi)
                if m.sum() < 10:
                    continue
                nll = [
                    -interpolate(lm[m], knn[m], lam, np.ones(m.sum(), bool)).mean()
                    for lam in LAMBDAS
                ]
                b = int(np.argmin(nll))
                rows.append(
                    (
                        g,
                        f"[{lo}, {hi})",
                        f"[{alo}, {ahi})",
                        int(m.sum()),
                        LAMBDAS[b],
                        f"{np.exp(nll[0] - nll[b]):.3f}x",
                    )
                )
    print(markdown_table(["text", "s", "agree", "tokens", "best lambda", "ppl gain"], rows))

    both = {
        k: np.concatenate([groups["heldout"][k], groups["reread_news"][k]])
        for k in groups["heldout"]
    }
    n_h, n_r = len(groups["heldout"]["gold"]), len(groups["reread_news"]["gold"])
    both["weight"] = np.r_[np.full(n_h, 0.5 / n_h), np.full(n_r, 0.5 / n_r)] * (n_h + n_r)
    fitted, _ = evidence.fit(both, 64, T)
    out = []
    for g, z in groups.items():
        d, v = z["distances"], z["values"]
        knn = knn_logprob(d, np.where(v >= 0, 0, -1), v, z["gold"][:, None], T)[:, 0]
        lm_ppl = float(np.exp(-z["target_lm_logprob"].mean()))
        cells = []
        for lam in (
            0.005,
            PRIOR.lambdas(d, v, z["qnorm"], T, z["context"]),
            fitted.lambdas(d, v, z["qnorm"], T, z["context"]),
        ):
            lp = interpolate(z["target_lm_logprob"], knn, lam, v[:, 0] >= 0)
            cells.append(f"{np.exp(-lp.mean()) / lm_ppl - 1:+.1%}")
        out.append((g, len(z["gold"]), f"{lm_ppl:.2f}", *cells))
    print()
    print(markdown_table(["text", "tokens", "LM ppl", "lambda 0.005", "prior", "refitted"], out))
    print(f"refitted: {fitted.to_json()}")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
