"""The trap numbers `multigpu doctor` prints point at docs/traps.md, and every one is a row there."""
from __future__ import annotations

import re
from pathlib import Path

from multigpu.cli.doctor import HEADLINE

REPO = Path(__file__).resolve().parents[2]
TRAPS = REPO / "docs" / "traps.md"


def table_numbers() -> set[int]:
    return {int(m) for m in re.findall(r"^\| (\d+) \|", TRAPS.read_text(), flags=re.M)}


def test_the_headline_names_the_page_of_the_traps():
    assert HEADLINE.endswith("trap numbers as in docs/traps.md")
    assert TRAPS.is_file()


def test_the_page_numbers_the_fifteen_traps_once_each():
    assert table_numbers() == set(range(1, 16))


def test_every_trap_number_in_the_source_is_a_row_of_the_page():
    used = set()
    for path in (REPO / "src" / "multigpu").rglob("*.py"):
        text = path.read_text()
        assert "PITFALLS" not in text, f"{path} cites a page that is not in the repository"
        used |= {int(n) for n in re.findall(r"\btrap[= ](\d+)", text)}
    assert used and used <= table_numbers(), sorted(used - table_numbers())
