"""Screenshot of a running service's dashboard (docs/img/dashboard.png), taken with the
Debian chromium through playwright, logging in through the page's own form.

    memlm up --demo --demo-days 5 &          # in a fresh data directory
    python scripts/dashboard_screenshot.py --nightly --failed-example

``--nightly`` stands in for the nightly schedule while the demo ingests: each time the
worker starts a new stream day it asks for a build (POST /admin/rebuild with a key per
day), so the page shows one index version per day, and one more once the queue is empty.
``--failed-example`` sends one document the model cannot read (a single token), so the
failed-documents table has a row with its reason. The admin token comes from
MEMLM_ADMIN_TOKEN (default: the development token) and is typed into the login form only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import httpx


def follow(api: httpx.Client, token: str, timeout_s: float) -> None:
    """Request a build at every new stream day, and one when the queue has emptied."""
    auth = {"Authorization": f"Bearer {token}"}
    built_for: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = api.get("/admin/stats/history", headers=auth).json()
        days = [d["day"] for d in h["days"]]
        busy = h["queue"]["counts"]["pending"] + h["queue"]["counts"]["processing"]
        # every day but the newest is complete while the worker goes in publication order
        complete = days if not busy else days[:-1]
        for day in complete:
            if day not in built_for:
                api.post("/admin/rebuild", headers=auth, json={"key": f"demo-nightly:{day}"})
                built_for.add(day)
                print(f"build requested after stream day {day}", flush=True)
        building = [b for b in h["builds"] if b["status"] in ("queued", "building")]
        if not busy and not building and days and set(days) <= built_for:
            return
        time.sleep(3)
    raise SystemExit(f"the demo did not finish within {timeout_s:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    ap.add_argument("--nightly", action="store_true", help="build after each stream day")
    ap.add_argument("--failed-example", action="store_true", help="ingest one unreadable doc")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the demo")
    ap.add_argument("--width", type=int, default=1400)
    args = ap.parse_args()
    token = os.environ.get("MEMLM_ADMIN_TOKEN", "change-me")
    ingest = os.environ.get("MEMLM_INGEST_TOKEN", "change-me")
    api = httpx.Client(base_url=args.url, timeout=60)
    if args.failed_example:
        doc = {
            "text": "Hello",
            "published_at": "2017-02-08",
            "source": "example.org",
            "title": "Too short to memorise",
        }
        api.post(
            "/ingest", headers={"Authorization": f"Bearer {ingest}"}, json={"documents": [doc]}
        )
    if args.nightly:
        follow(api, token, args.timeout)

    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("MEMLM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(
            viewport={"width": args.width, "height": 900}, device_scale_factor=1
        )
        page.goto(f"{args.url}/dashboard")
        page.fill("#token", token)
        page.click("button[type=submit]")
        page.wait_for_load_state()
        deadline = time.monotonic() + 30
        while not page.evaluate("document.body.dataset.generatedAt !== undefined"):
            if time.monotonic() > deadline:
                sys.exit("the dashboard did not draw within 30 s")
            time.sleep(0.2)
        time.sleep(1)  # plotly's transitions
        args.out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.out), full_page=True)
        browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
