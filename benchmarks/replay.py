"""The service delivers what the harness measures: a slice of the stream replayed over HTTP.

``memlm eval --lambda served`` scores each day's test documents against that day's
evening memory with the interpolation the service serves (the evidence model, and the
calibrator where it beats it: memlm/calibrator/combined.py).  This benchmark runs the same slice through a real server (the app
``memlm serve`` builds, with its embedded ingest worker, served by uvicorn on a port),
only through its HTTP API, as the scheduler and a user would:

1. ``memlm eval --policies monim --lambda served`` (``--lambda``) over the slice (a subprocess; its
   token cache lives under ``MEMLM_CACHE_DIR``); its ``split.json`` is the replay's plan,
   so both see the very same documents, deduplicated and screened as the harness does;
2. for each day: ``POST /ingest`` the day's training documents in the harness's order,
   wait until the worker has memorised them, ``POST /admin/rebuild`` (one key per day, as
   the nightly job) and wait until the new version serves; then ``POST /score`` each of
   the day's test documents: the day's evening memory, as the harness scores them;
3. one table: test ppl through ``/score`` against the harness's, the bare LM's ppl (the
   ``lm_logprobs`` of ``/score`` against the harness's bare run), MemRate and entries.

Both sides run MoNIM at its default delta, float32 (``--precision``; the token cache of
another precision is another key space) and the default window (512 tokens, stride 256).

    MEMLM_THREADS=2 python benchmarks/replay.py
    MEMLM_THREADS=2 python benchmarks/replay.py --start 2017-01-06 --days 6 \
        --max-docs-per-day 20 --eval-out runs/replay-eval

``--eval-out``: where the eval writes; ``--reuse-eval`` reads the report already there
instead of running the eval again (run it with the same slice: its ``split.json`` is the
replay's plan, but its figures are taken as they are).

What cannot be the same, and why (the table's "rel. diff" is what they add up to; measured
at the default slice, docs/calibrator.md "The service replays what the harness measures"):

- **The tokens, the LM, the windows: the same.**  ``/score`` encodes a whole test article
  with the harness's windows (512, stride 256; ``max_score_tokens`` is raised so that a
  long article is one request): the same 2,557 test tokens and the bare LM's ppl to
  within 0.00%.
- **What the interpolation is fitted on.**  The harness fits each evening on its dev
  documents (held out, never memorised, searched against that evening's memory), and with
  ``--lambda served`` trains the calibrator on them too.  The service has no dev
  documents: each build fits on the held-out tokens its worker recorded at ingest (the
  first document of each day and a seeded 5% of the others, searched just before they
  joined the memory, and again as "seen"), and keeps a fit only if it beats the prior on
  a validation split of them.  So the service serves the prior for longer and its
  calibrator trains later (2026-11-27, ``--lambda served``: +0.71%, most of it the third
  evening, where the harness serves the combination and the service the evidence;
  docs/calibrator.md, "The service replays what the harness measures").
- **MoNIM's decisions.**  Both decide with the interpolation they serve at the time (the
  prior, then each evening's fit), so the second day's entries differ as the first
  evening's interpolation does (12 more entries of 8,110; 20 of 12,695 at the end; they
  move the ppl by -0.08%).
- **k.**  The harness scores its test tokens at the k it tunes on the whole run's dev
  tokens (1024 at the default slice); the service at the k of its served grid (64).  At
  the fitted T 1 the neighbour weights are concentrated: 64 instead of 1024 changes the
  harness's ppl by less than 0.001%.
- **The index.**  Both search an exact flat index below 50k entries
  (``IndexParams.for_size``); on bigger slices both move to IVF-PQ by the same rule, and
  the service also searches the entries added since its last build exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import load_average, markdown_table, serving, stopwatch

DEFAULT_START = "2017-01-06"  # three full days of the bundled news (43, 39, 43 articles)


def eval_command(args: argparse.Namespace, out: Path) -> list[str]:
    """The ``memlm eval`` the replay is compared with (its split is the replay's)."""
    cmd = [
        sys.executable,
        "-m",
        "memlm.cli",
        "eval",
        "--out",
        str(out),
        "--start",
        args.start,
        "--days",
        str(args.days),
        "--policies",
        "monim",
        "--lambda",
        args.lam,
        "--precision",
        args.precision,
        "--device",
        "cpu",
        "--forgetting",
        "",
        "--no-names",
    ]
    if args.max_docs_per_day is not None:
        cmd += ["--max-docs-per-day", str(args.max_docs_per_day)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


def ppl(logprobs: Sequence[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs)) if logprobs else float("nan")


def rel(a: float, b: float) -> str:
    """``a`` against ``b`` in percent, signed."""
    return f"{(a / b - 1) * 100:+.2f}%" if b else "-"


def replay(
    plans: Sequence[Any], settings: Any, *, echo: Any = print
) -> tuple[dict[str, list[float]], list[dict[str, Any]], dict[str, Any]]:
    """Stream ``plans`` through a real server over HTTP; returns the test tokens' log-probs
    (``logprobs`` served, ``lm``), one record per day and the final ``/admin/stats``."""
    from memlm.cli.compose import build_app
    from memlm.client import Client
    from memlm.db.migrate import upgrade

    upgrade(settings.db_url)
    app = build_app(settings)
    token = settings.admin_token.get_secret_value()
    out: dict[str, list[float]] = {"logprobs": [], "lm": []}
    days: list[dict[str, Any]] = []
    with serving(app) as url, Client(url, token=token, timeout=3600) as client:
        for plan in plans:
            with stopwatch() as t:
                accepted = client.ingest(
                    {
                        "text": d.text,
                        "published_at": d.published_at.isoformat(),
                        "source": d.source,
                        "external_id": d.id,
                        "title": d.title[:1000],
                    }
                    for d in plan.train
                )
                done = client.wait([a.id for a in accepted], timeout=3600)
                failed = [d.id for d in done if d.status != "done"]
                if failed:
                    raise RuntimeError(f"{plan.day}: documents {failed} not memorised")
                build = client.rebuild(f"replay-{plan.day.isoformat()}", wait=True)
                if build.status != "done":
                    raise RuntimeError(
                        f"{plan.day}: build {build.id} {build.status}: {build.error}"
                    )
                stats = _serving(client, build.version)
                day_lp: list[float] = []
                for d in plan.test:
                    r = client.score(d.text)
                    out["logprobs"] += r.logprobs
                    out["lm"] += r.lm_logprobs
                    day_lp += r.logprobs
            interp = stats.interpolation.model_dump() if stats.interpolation else {}
            days.append(
                {
                    "day": plan.day.isoformat(),
                    "entries": stats.entries,
                    "tokens_seen": stats.tokens_seen,
                    "version": build.version,
                    "interpolation": interp,
                    "test_tokens": len(day_lp),
                    "test_ppl": ppl(day_lp),
                    "seconds": round(t.seconds, 1),
                }
            )
            echo(
                f"{plan.day}: {len(plan.train)} ingested, entries {stats.entries}, "
                f"version {build.version}, {len(plan.test)} test documents "
                f"ppl {ppl(day_lp):.2f} ({t.seconds:.0f} s)"
            )
        final = client.stats().model_dump(mode="json")
    return out, days, final


def _serving(client: Any, version: str | None, timeout: float = 60.0) -> Any:
    """``/admin/stats`` once the server serves ``version`` (the embedded worker swaps the
    index in at once; the poll catches up otherwise)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if version is None or str(stats.index.served_version) == str(version):
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"version {version} not served after {timeout} s")
        time.sleep(0.2)


def server_settings(args: argparse.Namespace, data_dir: Path) -> Any:
    """The settings ``memlm up`` would read, on a fresh data directory: the defaults
    (MoNIM, the evidence interpolation, held-out recording), the eval's precision."""
    from memlm.settings import Settings

    return Settings(  # type: ignore[call-arg]
        _env_file=None,
        data_dir=data_dir,
        policy="monim",
        precision=args.precision,
        device="cpu",
        threads=args.threads,
        worker_poll_seconds=0.2,
        index_poll_seconds=0.5,
        # a whole test article in one /score, as the harness scores it (default 2048)
        max_score_tokens=100_000,
        max_text_chars=1_000_000,
        queue_budget_s=3600,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", default=DEFAULT_START, help="first day (ISO date)")
    ap.add_argument("--days", type=int, default=3)
    ap.add_argument("--max-docs-per-day", type=int, default=8, help="0: the whole day")
    ap.add_argument("--precision", default="float32")
    ap.add_argument(
        "--lambda",
        dest="lam",
        choices=("served", "evidence"),
        default="served",
        help="the harness's interpolation: served (what the service serves) or evidence",
    )
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", 0)) or None)
    ap.add_argument("--eval-out", type=Path, default=None, help="the eval's output directory")
    ap.add_argument(
        "--reuse-eval", action="store_true", help="read --eval-out's report instead of running"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write every figure here")
    args = ap.parse_args()
    if args.max_docs_per_day == 0:
        args.max_docs_per_day = None

    from memlm.corpus import load_news
    from memlm.evaluate.plan import plan_from_split

    print(f"load average before: {load_average()}")
    eval_out = args.eval_out or Path(tempfile.mkdtemp(prefix="replay-eval-"))
    cmd = eval_command(args, eval_out)
    print("harness: " + " ".join(c if c else '""' for c in cmd[2:]))
    if not (args.reuse_eval and (eval_out / "report.json").exists()):
        with stopwatch() as t_eval:
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        print(f"harness ran in {t_eval.seconds:.0f} s")
    report = json.loads((eval_out / "report.json").read_text())
    split = json.loads((eval_out / "split.json").read_text())
    plans = plan_from_split(load_news(), split)
    # the harness's days, those with nothing left after dedup included, in its order
    print(
        f"{len(plans)} days, {sum(len(p.train) for p in plans)} ingested, "
        f"{sum(len(p.test) for p in plans)} test documents"
    )

    data_dir = Path(tempfile.mkdtemp(prefix="replay-data-"))
    with stopwatch() as t_replay:
        served, days, final = replay(plans, server_settings(args, data_dir))
    print(f"replay ran in {t_replay.seconds:.0f} s (data in {data_dir})")

    h_mon, h_bare = report["results"]["monim"], report["results"]["bare"]
    r_ppl, r_lm = ppl(served["logprobs"]), ppl(served["lm"])
    rows = [
        (f"test ppl ({args.lam})", r_ppl, h_mon["test_ppl"], rel(r_ppl, h_mon["test_ppl"])),
        ("bare LM test ppl", r_lm, h_bare["test_ppl"], rel(r_lm, h_bare["test_ppl"])),
        ("test tokens", len(served["logprobs"]), h_mon["test_tokens"], "-"),
        ("MemRate", final["memrate"], h_mon["memrate"], rel(final["memrate"], h_mon["memrate"])),
        ("entries", final["entries"], h_mon["entries"], rel(final["entries"], h_mon["entries"])),
    ]
    print()
    print(
        markdown_table(
            ["", "replay (/score)", "memlm eval", "rel. diff"], rows, digits=3, align="lrrr"
        )
    )
    h_days = {r["day"]: r for r in report.get("per_day", {}).get("monim", [])}
    h_ppl = harness_day_ppl(eval_out / "test_documents.json")
    day_rows = [
        (
            d["day"],
            d["entries"],
            h_days.get(d["day"], {}).get("entries", "-"),
            d["test_tokens"],
            d["test_ppl"],
            h_ppl.get(d["day"], float("nan")),
            _served(d["interpolation"]),
        )
        for d in days
    ]
    print()
    header = ["day", "entries (replay)", "entries (eval)", "test tokens", "replay ppl"]
    header += ["eval ppl", "served by the replay"]
    print(markdown_table(header, day_rows, digits=2, align="lrrrrrl"))
    print(f"\nload average after: {load_average()}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"rows": rows, "days": days, "harness": report["results"], "stats": final},
                indent=1,
                default=str,
            )
        )


def harness_day_ppl(path: Path, system: str = "monim") -> dict[str, float]:
    """The harness's test ppl of each day, from its ``test_documents.json``."""
    data = json.loads(path.read_text())
    sums: dict[str, list[float]] = {}
    for doc, lp in zip(data["documents"], data["logprob_sums"][system], strict=True):
        acc = sums.setdefault(doc["day"], [0.0, 0.0])
        acc[0] += lp
        acc[1] += doc["tokens"]
    return {day: math.exp(-lp / n) for day, (lp, n) in sums.items() if n}


def _served(interp: dict[str, Any]) -> str:
    """The served interpolation in a few words: its source, k, T."""
    if not interp:
        return "-"
    ev = interp.get("evidence") or {}
    what = interp.get("lambda_source", "-")
    if ev:
        what += f" ({ev.get('source')}, {ev.get('fitted_tokens', 0)} tok)"
    return f"{what} k={interp.get('k')} T={interp.get('temperature')}"


if __name__ == "__main__":
    main()
