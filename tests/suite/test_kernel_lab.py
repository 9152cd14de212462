"""tools/kernel_lab.py: its command line, the rounds docs/performance-notes.md cites, and one
round's check of its variants under the interpreter (timing a round needs a GPU)."""

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from ..conftest import requires_interpret

ROOT = Path(__file__).resolve().parents[2]
# `tools/kernel_lab.py ROUND`, and "(commit SHA)" after it for a round kept in main's history.
CITATION = re.compile(r"tools/kernel_lab\.py ([\w-]+)`? ?(?:\(commit ([0-9a-f]{7,40})\))?")


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


def _citations() -> list[tuple[str, str]]:
    notes = " ".join((ROOT / "docs" / "performance-notes.md").read_text(encoding="utf-8").split())
    return CITATION.findall(notes)


def test_the_notes_cite_the_rounds_on_main_and_the_commit_of_the_others(lab):
    """Every round the notes cite as a command without a commit is a round of the lab on main (a
    round removed since is cited with "(commit SHA)"), and every round on main is cited."""
    untagged = {name for name, commit in _citations() if not commit}
    missing = sorted(untagged - set(lab.ROUNDS))
    assert missing == [], f"cited as lab commands but not rounds on main (cite their commit): {missing}"
    uncited = sorted(set(lab.ROUNDS) - untagged)
    assert uncited == [], f"rounds on main that docs/performance-notes.md never cites as a command: {uncited}"


def test_a_round_cited_at_a_commit_is_a_round_of_the_lab_there():
    """The commit is in the repository (a clone has it), and its tools/kernel_lab.py has the round."""
    cited = sorted({(commit, name) for name, commit in _citations() if commit})
    assert cited, "the notes cite no removed round"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the cited commits cannot be read")
    sources = {}
    for commit, name in cited:
        if commit not in sources:
            done = subprocess.run(
                ["git", "show", f"{commit}:tools/kernel_lab.py"], cwd=ROOT, capture_output=True, text=True
            )
            assert done.returncode == 0, f"commit {commit} (cited in the notes): {done.stderr.strip()}"
            sources[commit] = done.stdout
        assert f'    "{name}": round_' in sources[commit], (
            f"no round {name} in tools/kernel_lab.py at {commit}"
        )


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
