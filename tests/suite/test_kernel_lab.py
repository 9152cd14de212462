"""tools/kernel_lab.py: its command line, the rounds docs/performance-notes.md cites, and one
round's check of its variants under the interpreter (timing a round needs a GPU)."""

import importlib.util
import re
from pathlib import Path

import pytest

from ..conftest import requires_interpret

ROOT = Path(__file__).resolve().parents[2]
# `tools/kernel_lab.py ROUND`, and "(tag NAME)" after it for a round kept at a git tag.
CITATION = re.compile(r"tools/kernel_lab\.py ([\w-]+)`? ?(\(tag [\w-]+\))?")


@pytest.fixture(scope="module")
def lab():
    spec = importlib.util.spec_from_file_location("kernel_lab", ROOT / "tools" / "kernel_lab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_lists_every_round(lab, capsys):
    with pytest.raises(SystemExit) as exit_:
        lab.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert [name for name in lab.ROUNDS if name not in out] == []


def test_the_notes_cite_the_rounds_on_main_and_tag_the_others(lab):
    """Every round the notes cite as a command without a tag is a round of the lab on main (a
    round moved to a git tag is cited with "(tag NAME)"), and every round on main is cited."""
    notes = " ".join((ROOT / "docs" / "performance-notes.md").read_text(encoding="utf-8").split())
    untagged = {name for name, tag in CITATION.findall(notes) if not tag}
    missing = sorted(untagged - set(lab.ROUNDS))
    assert missing == [], f"cited as lab commands but not rounds on main (cite their tag): {missing}"
    uncited = sorted(set(lab.ROUNDS) - untagged)
    assert uncited == [], f"rounds on main that docs/performance-notes.md never cites as a command: {uncited}"


def test_smoke_needs_the_interpreter(lab, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_:
        lab.main(["even", "--smoke"])
    assert exit_.value.code == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


@pytest.mark.interpret
@requires_interpret
def test_round_even_checks_every_variant_under_the_interpreter(lab, capsys):
    assert lab.main(["even", "--smoke"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("EVEN=True" in line for line in lines)
    assert [line for line in lines if not line.endswith(" checked")] == []
