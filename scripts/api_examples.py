"""Capture every endpoint's curl example and real response from a running `memlm up --demo`.

Starts `memlm up --demo` in a fresh data directory (bundled SmolLM2 unless --model says
otherwise), waits until the demo news is memorised, runs one call per endpoint in a fixed
order, and writes

  - docs/api.md: every call with its full response;
  - the README section between the `api-examples` markers: the same calls, each response
    shortened (lists cut to their first items, long strings cut).

    python scripts/api_examples.py                   # about 5-10 minutes on one thread
    python scripts/api_examples.py --model tiny-llama --demo-days 1   # a quick dry run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "change-me"  # the development default of MEMLM_INGEST_TOKEN / MEMLM_ADMIN_TOKEN
SHOWN_URL = "localhost:8000"
README_BEGIN = "<!-- api-examples:begin (scripts/api_examples.py writes this section) -->"
README_END = "<!-- api-examples:end -->"

ECB = {
    "text": "The European Central Bank left its key interest rates unchanged on Thursday "
    "and said it would keep buying bonds until the end of the year.",
    "published_at": "2017-02-07",
    "source": "example.org",
    "external_id": "ecb-1",
    "title": "ECB holds rates",
}
# the start of a demo article: the memory should complete it
CONTEXT = "China National Petroleum Corp is to split its natural gas sales and"


@dataclass
class Call:
    title: str
    method: str
    path: str
    body: Any = None
    auth: bool = False
    note: str = ""


def calls() -> list[Call]:
    """The calls in order; ``{id}`` in a path is the document the first ingest created."""
    return [
        Call("GET /healthz", "GET", "/healthz"),
        Call("GET /readyz", "GET", "/readyz"),
        Call("POST /ingest", "POST", "/ingest", {"documents": [ECB]}, auth=True),
        Call(
            "POST /ingest (the same document again: deduplicated)",
            "POST",
            "/ingest",
            {
                "documents": [
                    {
                        "text": "Different text, same source and external id.",
                        "published_at": "2017-02-07",
                        "source": "example.org",
                        "external_id": "ecb-1",
                    }
                ]
            },
            auth=True,
        ),
        Call(
            "GET /documents/{id}",
            "GET",
            "/documents/{id}",
            note="After the worker memorised it:",
            auth=True,
        ),
        Call(
            "POST /predict",
            "POST",
            "/predict",
            {"context": CONTEXT, "top_n": 5, "neighbours": 3},
        ),
        Call(
            "POST /predict (whole words)",
            "POST",
            "/predict",
            {"context": CONTEXT, "top_n": 3, "words": 5},
        ),
        Call(
            "POST /generate",
            "POST",
            "/generate",
            {"context": CONTEXT, "max_tokens": 8, "neighbour": True},
            note='Greedy, each token with its nearest neighbour (`"stream": true` sends '
            "the same tokens as server-sent events):",
        ),
        Call(
            "POST /predict (TRIME local memory)",
            "POST",
            "/predict",
            {
                "context": "Gas sales and pipeline units will be split. Gas sales and",
                "top_n": 3,
                "local_memory": True,
            },
        ),
        Call(
            "POST /score",
            "POST",
            "/score",
            {"text": "The central bank left interest rates unchanged."},
        ),
        Call(
            "POST /score (TRIME local memory)",
            "POST",
            "/score",
            {"text": "Rates were unchanged. Rates were unchanged.", "local_memory": True},
        ),
        Call("POST /admin/rebuild", "POST", "/admin/rebuild", auth=True),
        Call("GET /admin/builds/{id}", "GET", "/admin/builds/1", auth=True),
        Call("GET /admin/stats", "GET", "/admin/stats", auth=True),
        Call(
            "POST /predict (after the rebuild: the evidence fitted)",
            "POST",
            "/predict",
            {"context": CONTEXT, "top_n": 3},
            note="After the first rebuild: the build fitted the evidence interpolation on the "
            "held-out tokens the worker recorded (`interpolation.evidence` in the build record "
            "above; the NN calibrator needs more of them), and the memorised context is still "
            "answered from memory (docs/calibrator.md):",
        ),
        Call(
            "POST /score (after the rebuild)",
            "POST",
            "/score",
            {"text": "The central bank left interest rates unchanged."},
        ),
        Call("GET /admin/policy", "GET", "/admin/policy", auth=True),
        Call(
            "PUT /admin/policy",
            "PUT",
            "/admin/policy",
            {"policy": "monim-amt", "delta": -1.5},
            auth=True,
        ),
        Call("DELETE /admin/documents/{id}", "DELETE", "/admin/documents/{id}", auth=True),
        Call("GET /documents/{id} after forgetting", "GET", "/documents/{id}", auth=True),
        Call("GET /metrics", "GET", "/metrics"),
        Call(
            "Error: missing token",
            "POST",
            "/ingest",
            {"documents": []},
        ),
        Call(
            "Error: invalid document",
            "POST",
            "/ingest",
            {"documents": [{"text": " ", "published_at": "2017-02-30", "source": "x"}]},
            auth=True,
        ),
    ]


def curl(c: Call, path: str) -> str:
    parts = ["curl"]
    if c.method != "GET":
        parts += ["-X", c.method]
    parts.append(f"{SHOWN_URL}{path}")
    if c.auth:
        parts += ["-H", f"Authorization: Bearer {TOKEN}"]
    if c.body is not None:
        parts += ["-H", "Content-Type: application/json", "-d", json.dumps(c.body)]
    return " ".join(shlex.quote(p) for p in parts)


def shorten(x: Any, items: int = 1, chars: int = 100) -> Any:
    """A response cut for the README: the first list items, long strings cut."""
    if isinstance(x, dict):
        return {k: shorten(v, items, chars) for k, v in x.items()}
    if isinstance(x, list):
        head = [shorten(v, items, chars) for v in x[:items]]
        return head + ([f"... {len(x) - items} more"] if len(x) > items else [])
    if isinstance(x, str) and len(x) > chars:
        return x[:chars] + "..."
    if isinstance(x, float):
        return float(f"{x:.4g}")
    return x


def status_line(r: httpx.Response) -> str:
    line = f"`{r.status_code} {HTTPStatus(r.status_code).phrase}`"
    if "www-authenticate" in r.headers:
        line += f" `www-authenticate: {r.headers['www-authenticate']}`"
    return line


def body_block(r: httpx.Response, short: bool) -> str:
    """The response body: indented JSON, or for the README one line of shortened JSON."""
    if r.headers.get("content-type", "").startswith("application/json"):
        data = r.json()
        if short:
            return "```json\n" + json.dumps(shorten(data), ensure_ascii=False) + "\n```"
        return "```json\n" + json.dumps(data, indent=2, ensure_ascii=False) + "\n```"
    text = r.text
    if short:  # Prometheus text: a few of memlm's own lines
        keep = [ln for ln in text.splitlines() if ln.startswith("memlm_")]
        text = "\n".join(keep[:6]) + f"\n... {len(keep) - 6} more memlm_ lines"
    return "```\n" + text.rstrip() + "\n```"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(what: str, check: Any, timeout: float) -> Any:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            out = check()
        except httpx.HTTPError:
            out = None
        if out:
            return out
        time.sleep(1.0)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--demo-days", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--docs-out", type=Path, default=ROOT / "docs" / "api.md")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--no-readme", action="store_true", help="write docs/api.md only")
    args = ap.parse_args()

    data = Path(tempfile.mkdtemp(prefix="memlm-api-examples-"))
    port = free_port()
    env = {
        **os.environ,
        "MEMLM_DATA_DIR": str(data),
        "MEMLM_MODEL": args.model,
        "MEMLM_THREADS": str(args.threads),
        "MEMLM_WORKER_POLL_SECONDS": "0.5",
        "MEMLM_INDEX_POLL_SECONDS": "1",
    }
    env.pop("MEMLM_DATABASE_URL", None)
    cmd = [sys.executable, "-m", "memlm.cli", "up", "--demo", "--demo-days", str(args.demo_days)]
    cmd += ["--port", str(port)]
    log = open(data / "server.log", "w")  # noqa: SIM115 - open for the server's lifetime
    t_start = time.monotonic()
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    admin = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            wait("the server", lambda: c.get("/readyz").status_code == 200, 600)
            t_ready = time.monotonic() - t_start

            def demo_done() -> bool:
                docs = c.get("/admin/stats", headers=admin).json()["documents"]
                return docs.get("pending", 0) + docs.get("processing", 0) == 0

            wait("the demo articles", demo_done, 3600)
            t_demo = time.monotonic() - t_start
            stats = c.get("/admin/stats", headers=admin).json()
            doc_id = None
            sections: list[tuple[Call, str, httpx.Response]] = []
            for call in calls():
                path = call.path.replace("{id}", str(doc_id))
                if call.title == "GET /documents/{id}":
                    wait(
                        "the new document",
                        lambda p=path: c.get(p, headers=admin).json()["status"] == "done",
                        600,
                    )
                if call.title == "GET /admin/builds/{id}":
                    wait(
                        "the build",
                        lambda: (
                            c.get("/admin/builds/1", headers=admin).json()["status"]
                            in ("done", "failed")
                        ),
                        1800,
                    )
                if "forgetting" in call.title:
                    wait(
                        "the forget",
                        lambda p=path: c.get(p, headers=admin).json()["status"] == "forgotten",
                        600,
                    )
                headers = admin if call.auth else {}
                r = c.request(call.method, path, json=call.body, headers=headers)
                if doc_id is None and call.title == "POST /ingest":
                    doc_id = r.json()["documents"][0]["id"]
                sections.append((call, path, r))
    finally:
        server.terminate()
        server.wait(60)
        log.close()

    today = dt.date.today().isoformat()
    intro = (
        f"Captured on {today} by `python scripts/api_examples.py` (model `{args.model}`, "
        f"{args.threads} thread): `memlm up --demo --demo-days {args.demo_days}` in a fresh "
        f"data directory was ready after {t_ready:.0f} s and had memorised the "
        f"{stats['documents']['done']} demo articles ({stats['tokens_seen']} tokens, "
        f"{stats['entries']} entries) after {t_demo:.0f} s; then the calls below ran in this "
        f"order. URLs are shown as `{SHOWN_URL}`; `change-me` is the development token."
    )
    full = ["# API examples", "", intro, ""]
    short = [intro, ""]
    for call, path, r in sections:
        for out, is_short in ((full, False), (short, True)):
            out += [("#### " if is_short else "### ") + call.title, ""]
            if call.note:
                out += [call.note, ""]
            out += ["```bash", curl(call, path), "```", "", status_line(r), ""]
            out += [body_block(r, is_short), ""]
    args.docs_out.write_text("\n".join(full))
    print(f"wrote {args.docs_out}")
    if not args.no_readme:
        text = args.readme.read_text()
        head, rest = text.split(README_BEGIN, 1)
        _, tail = rest.split(README_END, 1)
        body = "\n".join(short)
        args.readme.write_text(f"{head}{README_BEGIN}\n{body}\n{README_END}{tail}")
        print(f"updated {args.readme}")


if __name__ == "__main__":
    main()
