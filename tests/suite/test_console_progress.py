"""Progress on long work: a bar on a terminal, plain lines elsewhere (CI logs stay readable)."""

from __future__ import annotations

from rmsnorm_suite import console, harness


def test_progress_off_a_terminal_is_plain_lines(capsys):
    assert list(console.progress(range(25), "grid")) == list(range(25))
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines()[0] == "grid: 2/25" and err.splitlines()[-1] == "grid: 25/25"
    assert len(err.splitlines()) == 13  # every second item of 25, and the last


def test_the_harness_bar_off_a_terminal_is_plain_lines(capsys):
    bar = harness._Progress(40, "benchmark", True)
    for i in range(40):
        bar.step(f"case {i}")
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines()[-1] == "[40/40] case 39" and len(err.splitlines()) == 20
