"""Every figure the README's Results section and each docs/bench page's "What we know" state, recomputed from the raw
files under docs/bench the row or bullet links (tests/results_figures.py says how): a number edited, dropped to fewer
decimals or left without a file fails, and so does a row or bullet no claim checks. The last test applies edits that
once passed to a copy of the text and asserts the check reports each, so the guarantee itself is tested."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from tests.results_figures import BENCH, CLAIMS, README, ROOT, Claim, numbers, reading

PAGES = sorted(p.name for p in BENCH.glob("*.md") if "\n## What we know\n" in p.read_text())
LINK = re.compile(r"\]\(([^)\s#]+)[^)\s]*\)")


@dataclass(frozen=True)
class Text:
    """A row or bullet: the doc it sits in, its text (a README row: its what and figure cells) and what it links,
    as paths under docs/bench."""
    doc: str
    text: str
    links: tuple[str, ...]
    what: str = ""  # a README row's what cell, where its claim's key is found; else the key opens the text


def under_bench(links: list[str], base: str) -> tuple[str, ...]:
    paths = [(ROOT / base / link).resolve() for link in links]
    return tuple(str(p.relative_to(BENCH)) for p in paths if p.is_relative_to(BENCH))


def results(readme: str) -> list[Text]:
    """The Results table's rows and the paragraph after it (which may read any file a row links)."""
    body = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    lines = body.splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == "| what | figure | data | write-up |" and set(table[1]) <= set("|- "), table[:2]
    rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in table[2:]]
    assert all(len(r) == 4 for r in rows), [r[0][:60] for r in rows if len(r) != 4]
    texts = [Text(README, f"{r[0]} | {r[1]}", under_bench(LINK.findall(r[2]), "."), r[0]) for r in rows]
    paragraph = " ".join("\n".join(lines[lines.index(table[-1]) + 1:]).split())
    return texts + [Text(README, paragraph, tuple(link for t in texts for link in t.links))]


def known(page: str, markdown: str) -> list[Text]:
    """A page's "What we know" bullets, each with its continuation lines."""
    body = markdown.split("\n## What we know\n", 1)[1].split("\n## ", 1)[0]
    bullets = [" ".join(b.split()) for b in re.split(r"\n(?=- )", body.strip())]
    return [Text(f"docs/bench/{page}", b.removeprefix("- "), under_bench(LINK.findall(b), "docs/bench")) for b in bullets]


def every_text(docs: dict[str, str]) -> list[Text]:
    return results(docs[README]) + [t for page in PAGES for t in known(page, docs[f"docs/bench/{page}"])]


def docs_now() -> dict[str, str]:
    return {README: (ROOT / README).read_text(), **{f"docs/bench/{p}": (BENCH / p).read_text() for p in PAGES}}


def matches(claim: Claim, text: Text) -> bool:
    return claim.doc == text.doc and (claim.key in text.what if text.what else text.text.startswith(claim.key))


def covered(read: str, links: tuple[str, ...]) -> bool:
    """A file or grid folder the claim read is linked: itself, a folder above it, or a file in the grid's folder (its
    merged report beside the runs)."""
    return any(read == link or read.startswith(f"{link}/") or link.startswith(f"{read}/") for link in links)


def problems(claim: Claim, docs: dict[str, str]) -> list[str]:
    """What is wrong with the claim's row or bullet in `docs`: numbers that are not the computed ones, in order, and
    files read that it does not link."""
    (text,) = [t for t in every_text(docs) if matches(claim, t)]
    with reading() as read:
        computed = [n for figure in claim.figures() for n in numbers(str(figure))]
    stated = numbers(text.text)
    found = [] if stated == computed else [f"{claim.doc} {claim.key!r}: states {stated}, the files give {computed}"]
    unlinked = sorted({p for p in read if not covered(p, text.links)})
    return found + ([f"{claim.doc} {claim.key!r}: reads {unlinked}, which it does not link"] if unlinked else [])


def test_every_row_and_bullet_has_one_claim():
    texts, claimed = every_text(docs_now()), {c.doc for c in CLAIMS}
    unchecked = [f"{t.doc}: {t.text[:70]}" for t in texts if sum(matches(c, t) for c in CLAIMS) != 1]
    assert unchecked == [], "rows and bullets without exactly one claim in tests/results_figures.py CLAIMS"
    stale = [c.key for c in CLAIMS if not any(matches(c, t) for t in texts)]
    assert stale == [], "claims for rows or bullets the docs no longer have"
    assert {f"docs/bench/{p}" for p in PAGES} | {README} == claimed, "a page's \"What we know\" with no claim"
    bare = [t.text[:60] for t in texts if t.doc == README and not t.links]
    assert bare == [], "Results rows that link no file under docs/bench"


@pytest.mark.parametrize("claim", CLAIMS, ids=[f"{c.doc.split('/')[-1]}:{c.key[:32]}" for c in CLAIMS])
def test_each_figure_is_what_its_files_give(claim):
    assert problems(claim, docs_now()) == []


def test_every_link_leads_to_a_file():
    missing = [(t.doc, link) for t in every_text(docs_now()) for link in t.links if not (BENCH / link).exists()]
    assert missing == []


# (doc, claim key, text in it, an edit that must be reported): the three edits a prefix-matching check let pass (a
# figure cut to another's prefix, a seed count, a question count), and the kinds beside them: two figures swapped, a
# page's bullet, a dropped decimal, a data link taken out
EDITS = [
    (README, "four SmolLM2-135M owners", "+0.086 ± 0.010", "+0.06 ± 0.02"),
    (README, "4 tiny nodes, 4 local + 4 external groups under `signal`", "3 seeds", "5 seeds"),
    (README, "four SmolLM2-135M owners", "products to 199", "products to 99"),
    (README, "two SmolLM2-135M nodes, 2/2 vs 4/0", "+4.1% ± 2.8 under `signal`, +5.9% ± 4.8",
     "+5.9% ± 4.8 under `signal`, +4.1% ± 2.8"),
    ("docs/bench/learning.md", "**Sharing pays on the tiny testbed.**", "+21.8% ± 4.0", "+21.8% ± 4.1"),
    ("docs/bench/learning.md", "**Four owners teach each other", "+0.060 ± 0.021", "+0.06 ± 0.021"),
    ("docs/bench/learning.md", "**A weaker peer hurts", "; [real-grid-2cpu/](real-grid-2cpu/).", "."),
]


@pytest.mark.parametrize("doc, key, old, new", EDITS, ids=[f"{key[:20]}:{new}" for _, key, _, new in EDITS])
def test_each_edit_is_reported(doc, key, old, new):
    docs = docs_now()
    (claim,) = [c for c in CLAIMS if c.doc == doc and c.key == key]
    assert problems(claim, docs) == [], "the edit is tested against a text that passes"
    (text,) = [t for t in every_text(docs) if matches(claim, t)]
    assert old in text.text, f"{old!r} is not in the claim's text"
    edited = {**docs, doc: docs[doc].replace(old, new)}
    assert problems(claim, edited) != []
