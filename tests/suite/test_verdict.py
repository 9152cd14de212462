"""`rmsnorm-kernel verdict`: one table, skipped checks never counted as passed, a failing or
crashing check fails the verdict, and the interpreter re-run when there is no CUDA."""

import json
import subprocess
import sys

import pytest

from rmsnorm_suite import cli, console, verdict
from rmsnorm_suite.config import parse_config

from ..conftest import requires_cuda, requires_interpret


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def passing(cfg, device):
    return True, "3/3 cases", {"n": 3}


def failing(cfg, device):
    return False, "1/3 cases", {}


def crashing(cfg, device):
    raise RuntimeError("kernel exploded\nsecond line")


def skipping(cfg, device):
    raise verdict.Skip("needs CUDA")


# (checks, expected statuses, verdict passes)
SCENARIOS = [
    ([passing, passing], ["pass", "pass"], True),
    ([passing, skipping], ["pass", "skipped"], True),
    ([passing, failing], ["pass", "FAIL"], False),
    ([crashing, passing], ["FAIL", "pass"], False),
]


@pytest.mark.parametrize("fns, statuses, passes", SCENARIOS)
def test_outcomes(fns, statuses, passes, monkeypatch):
    monkeypatch.setattr(verdict, "CHECKS", tuple((f"check {i}", fn) for i, fn in enumerate(fns)))
    outcomes = verdict.run_checks(parse_config({}), "cpu", log=lambda _: None)
    assert [o.status for o in outcomes] == statuses
    assert all(o.status != verdict.FAIL for o in outcomes) is passes


def test_crash_reason_is_one_line(monkeypatch):
    monkeypatch.setattr(verdict, "CHECKS", (("boom", crashing),))
    (outcome,) = verdict.run_checks(parse_config({}), "cpu", log=lambda _: None)
    assert outcome.figure == "raised RuntimeError: kernel exploded"
    assert "Traceback" in outcome.details["traceback"]


def test_skip_option(monkeypatch):
    monkeypatch.setattr(verdict, "CHECKS", (("a", passing), ("b", failing)))
    outcomes = verdict.run_checks(parse_config({}), "cpu", skip={"b"}, log=lambda _: None)
    assert [(o.check, o.status, o.figure) for o in outcomes] == [
        ("a", "pass", "3/3 cases"),
        ("b", "skipped", "skipped: --skip"),
    ]


def test_cuda_graphs_are_skipped_not_passed_on_cpu():
    with pytest.raises(verdict.Skip, match="needs CUDA"):
        verdict.check_cuda_graphs(parse_config({}), "cpu")


def test_a_failed_integration_check_fails_with_its_first_failure(monkeypatch):
    """opcheck, compile and CUDA graphs are the checks of rmsnorm_suite.torchchecks, which the tests
    share: the verdict fails the row and names the first failure."""
    from rmsnorm_suite import torchchecks

    result = torchchecks.Result("15/16 opcheck tests", ["forward float32 test_schema: bad"], {"opcheck": {}})
    monkeypatch.setattr(torchchecks, "opcheck", lambda device, dtypes, seed: result)
    passed, figure, details = verdict.check_opcheck(parse_config({}), "cpu")
    assert not passed
    assert figure == "15/16 opcheck tests; 1 failed, first: forward float32 test_schema: bad"
    assert details == {"opcheck": {}, "failures": ["forward float32 test_schema: bad"]}


def test_every_issue_check_is_in_the_verdict():
    assert verdict.CHECK_NAMES == (
        "environment",
        "reference gradcheck",
        "forward grid (y)",
        "backward grid (dx)",
        "gamma grid (dw)",
        "probe checks",
        "mutant catalogue",
        "opcheck",
        "torch.compile fullgraph",
        "CUDA graph capture",
        "batch invariance",
        "quantised output",
        "QK-norm",
        "training integration",
    )


@pytest.mark.parametrize("fns, rc", [([passing, skipping], 0), ([passing, failing], 1)])
def test_command_writes_table_markdown_and_json(fns, rc, project, monkeypatch, capsys):
    monkeypatch.setattr(verdict, "CHECKS", tuple((f"check {i}", fn) for i, fn in enumerate(fns)))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as in the re-run: no further subprocess
    monkeypatch.setattr(console, "resolve_device", lambda requested, command: "cpu")
    assert cli.main(["verdict"]) == rc
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["check", "status", "key", "figure"]
    assert ("PASS" if rc == 0 else "FAIL") in out
    md = (project / "outputs" / "verdict.md").read_text()
    assert md.startswith(f"# Verdict: {'PASS' if rc == 0 else 'FAIL'}")
    assert "| check 1 |" in md
    data = json.loads((project / "outputs" / "verdict.json").read_text())
    assert data["passed"] is (rc == 0)
    assert [c["status"] for c in data["checks"]] == ["pass", "skipped" if rc == 0 else "FAIL"]
    # what did not run is listed under the table, in all three outputs, with its reason
    unjudged = [r["what"] for r in data["not_judged"]]
    assert "the compiled GPU kernels" in unjudged
    assert any(what.startswith("timing") for what in unjudged)
    assert ("check 1" in unjudged) is (rc == 0)
    for text in (out, md):
        assert "Not judged here" in text and "- the compiled GPU kernels: no CUDA device" in text
        assert ("- check 1: needs CUDA" in text) is (rc == 0)


def test_cuda_verdict_still_lists_the_timing_it_never_judges():
    outcomes = [verdict.Outcome("a", verdict.PASS, "ok")]
    rows = verdict.not_judged("cuda", outcomes)
    assert [r["what"] for r in rows] == ["timing: latency, bandwidth, the regression gate"]
    assert "pr_verdict" in rows[0]["why"]


def test_reruns_itself_under_the_interpreter(project, monkeypatch):
    """Without CUDA and without TRITON_INTERPRET, the command runs again with TRITON_INTERPRET=1
    (the interpreter must be chosen before the kernels are defined) and returns that exit status."""
    calls = []

    def fake_run(argv, env):
        calls.append((argv, env))
        return subprocess.CompletedProcess(argv, 7)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(verdict.CHILD_ENV, raising=False)
    monkeypatch.setattr(verdict.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(verdict.subprocess, "run", fake_run)
    assert cli.main(["verdict", "--config", "c.yaml", "--json", "--skip", "opcheck"]) == 7
    ((argv, env),) = calls
    assert argv == [
        sys.executable,
        "-m",
        "rmsnorm_suite",
        "verdict",
        "--config",
        "c.yaml",
        "--json",
        "--skip",
        "opcheck",
    ]
    assert env["TRITON_INTERPRET"] == "1" and env[verdict.CHILD_ENV] == "1"


def test_rerun_happens_once(project, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(verdict.CHILD_ENV, "1")
    monkeypatch.setattr(verdict.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(verdict.subprocess, "run", lambda *a, **k: pytest.fail("must not re-run twice"))
    assert cli.main(["verdict"]) == 2
    assert "giving up" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The real checks
# ---------------------------------------------------------------------------------------------

SMALL = {"checks": {"grid": "shapes", "shapes": [[3, 257]], "dtypes": ["float32"]}}


@pytest.mark.interpret
@requires_interpret
def test_real_checks_under_the_interpreter(project, monkeypatch):
    """The verdict's own checks on the kernels, on a small grid; the mutant catalogue, the probes and
    training have their own tests and are left out here to keep this quick, and the reference
    gradcheck runs at two shapes (tests/op/test_contract.py runs every shape)."""
    from rmsnorm_suite.walkthrough import oraclecheck

    monkeypatch.setattr(oraclecheck, "GRADCHECK_SHAPES", ((3, 7), (2, 3, 5)))
    skip = {"probe checks", "mutant catalogue", "training integration"}
    outcomes = {o.check: o for o in verdict.run_checks(parse_config(SMALL), "cpu", skip, log=lambda _: None)}
    failed = {k: o.figure for k, o in outcomes.items() if o.status == verdict.FAIL}
    assert not failed
    assert outcomes["CUDA graph capture"].status == "skipped"
    assert outcomes["CUDA graph capture"].figure == "skipped: needs CUDA"
    assert outcomes["forward grid (y)"].figure.startswith("1/1 cases")
    assert outcomes["reference gradcheck"].figure.startswith("4/4 shapes x offsets")
    assert outcomes["opcheck"].status == "pass"
    assert outcomes["torch.compile fullgraph"].status == "pass"


@pytest.mark.gpu
@pytest.mark.slow
@requires_cuda
def test_full_verdict_on_cuda(project):
    """The whole verdict on the GPU, as `nox -s verdict` runs it, from an empty folder (the mutant
    catalogue, thresholds and config come with the package)."""
    proc = subprocess.run(
        [sys.executable, "-m", "rmsnorm_suite", "verdict", "--json"], capture_output=True, text=True
    )
    data = json.loads(proc.stdout)
    failed = {c["check"]: c["figure"] for c in data["checks"] if c["status"] == "FAIL"}
    assert proc.returncode == 0 and not failed, failed
    statuses = {c["check"]: c["status"] for c in data["checks"]}
    assert statuses["CUDA graph capture"] == "pass"
    assert statuses["mutant catalogue"] == "pass"


def test_mutant_warnings_are_captured_and_counted(project, monkeypatch, recwarn):
    """The mutants' overflow warnings are expected: counted in the figure, not printed; others pass."""
    import warnings

    from rmsnorm_suite import mutanthunt

    def catalogue(device):
        warnings.warn("overflow encountered in multiply", RuntimeWarning, stacklevel=1)
        warnings.warn("divide by zero encountered in divide", RuntimeWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
        return [
            {
                "mutant": "m",
                "caught": True,
                "check": "c",
                "kind": "k",
                "case": "x",
                "reason": "r",
                "also_caught_by": [],
            }
        ]

    monkeypatch.setattr(mutanthunt, "catalogue", catalogue)
    monkeypatch.setattr(mutanthunt, "format_report", lambda entries: "report")
    passed, figure, details = verdict.check_mutants(parse_config({"output_dir": "out"}), "cpu")
    assert (
        passed and figure == "1/1 mutants caught (2 expected overflow/NaN warnings of the mutants captured)"
    )
    assert details["expected_warnings"] == [
        "divide by zero encountered in divide",
        "overflow encountered in multiply",
    ]
    assert [str(w.message) for w in recwarn] == ["something else"]
