"""The README's results tables quote measurements: every number in them must be on a results page.

The README's "Results on the embedded default" section (its subsections included) summarises what
docs/results/*.md records, with the date, commit and command of each run.  A number in its tables that no
results page holds was typed, rounded or carried over from an older run, so it is reported here.

Only numbers that can identify a measurement are checked: those with a decimal point ("29.8", "1.50", each
end of "1.29–1.71") or with three digits or more.  Integers of one or two digits (8 episodes, 32 tokens) are
too common to mean anything.  A number counts as present when a results page holds the same number, not
merely its digits inside another one ("1.5" is not "1.50").
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results"
SECTION = "## Results on the embedded default"
NUMBER = re.compile(r"\d+(?:\.\d+)?", re.ASCII)


def meaningful_numbers(text: str) -> set[str]:
    """The numbers in ``text`` that can identify a measurement: with a decimal point, or of three digits or more."""
    return {number for number in NUMBER.findall(text) if "." in number or len(number) >= 3}


def readme_results_table_rows() -> list[str]:
    """The table rows (lines starting with "|") of the README's results section, up to the next "## " heading."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert SECTION in lines, f"README.md has no {SECTION!r} heading"
    rows = []
    for line in lines[lines.index(SECTION) + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append(line)
    return rows


def numbers_on_results_pages() -> set[str]:
    """Every meaningful number written anywhere in docs/results/*.md."""
    pages = sorted(RESULTS.glob("*.md"))
    assert pages, f"no results pages under {RESULTS}"
    return set().union(*(meaningful_numbers(page.read_text(encoding="utf-8")) for page in pages))


def test_every_number_in_the_readme_results_tables_is_on_a_results_page():
    """Each number of the README's results tables appears in docs/results/*.md; the message lists those that do not."""
    rows = readme_results_table_rows()
    assert rows, f"README.md's {SECTION!r} section has no table"
    on_pages = numbers_on_results_pages()
    missing: dict[str, list[str]] = {}
    for row in rows:
        label = row.strip("|").split("|")[0].strip()
        for number in sorted(meaningful_numbers(row) - on_pages, key=float):
            missing.setdefault(number, []).append(label)
    assert not missing, "numbers in README.md's results tables that no page in docs/results/ holds: " + "; ".join(
        f"{number} (row {', '.join(labels)})" for number, labels in sorted(missing.items(), key=lambda item: float(item[0]))
    )
