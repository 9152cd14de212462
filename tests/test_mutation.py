"""The mutation runner's own logic (rmsnorm_suite.mutation), on CPU and without running a
mutant: the catalogue applies exactly once, the score and its interval, the floor check, the
sample, and the report. The mutation run itself is `nox -s mutation`."""

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rmsnorm_suite import mutation
from rmsnorm_suite.mutation import MutationError, Patch, Score

ROOT = Path(__file__).resolve().parents[1]


def test_every_catalogue_patch_applies_exactly_once_to_the_current_code():
    patches = mutation.load_catalogue(ROOT)
    mutation.check_catalogue(patches, ROOT)
    paths = {p.path for p in patches}
    assert {"tile", "EVEN", "two-walk", "wide", "cooperative"} <= paths


def test_a_patch_whose_old_text_is_missing_or_repeated_is_an_error():
    patch = Patch("p", "wrong denominator", "tile", "k.py", "/ N", "/ BLOCK_N")
    assert mutation.apply_patch("a / N + eps", patch) == "a / BLOCK_N + eps"
    with pytest.raises(MutationError, match="occurs 0 times"):
        mutation.apply_patch("a / M", patch)
    with pytest.raises(MutationError, match="occurs 2 times"):
        mutation.apply_patch("a / N + b / N", patch)


def test_catalogue_entries_are_checked(tmp_path):
    (tmp_path / "mutation").mkdir()
    (tmp_path / "k.py").write_text("x = a / N\n")
    cat = tmp_path / "mutation" / "catalogue.toml"
    entry = '[[patch]]\nid = "a"\nfailure = "f"\npath = "tile"\nfile = "k.py"\nold = "/ N"\nnew = "/ ("\n'
    cat.write_text(entry)
    with pytest.raises(MutationError, match="invalid Python"):
        mutation.check_catalogue(mutation.load_catalogue(tmp_path), tmp_path)
    cat.write_text(entry + entry)
    with pytest.raises(MutationError, match="appears twice"):
        mutation.load_catalogue(tmp_path)
    cat.write_text('[[patch]]\nid = "a"\nfile = "k.py"\n')
    with pytest.raises(MutationError, match="lacks failure, path, old, new"):
        mutation.load_catalogue(tmp_path)


@pytest.mark.parametrize(
    ("killed", "total", "low", "high"),
    # Wilson 95% intervals (z = 1.95996), as scipy.stats.binomtest(k, n).proportion_ci("wilson") gives
    [(27, 30, 0.7438, 0.9654), (30, 30, 0.8865, 1.0), (0, 10, 0.0, 0.2775), (95, 100, 0.8883, 0.9785)],
)
def test_wilson_interval(killed, total, low, high):
    lo, hi = mutation.wilson_interval(killed, total)
    assert lo == pytest.approx(low, abs=1e-4) and hi == pytest.approx(high, abs=1e-4)


def test_wilson_interval_agrees_with_scipy():
    stats = pytest.importorskip("scipy.stats")
    for k, n in [(1, 7), (40, 43), (12, 12)]:
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        lo, hi = mutation.wilson_interval(k, n)
        assert lo == pytest.approx(ci.low, abs=1e-9) and hi == pytest.approx(ci.high, abs=1e-9)


def test_wilson_interval_rejects_impossible_counts():
    assert mutation.wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="killed"):
        mutation.wilson_interval(5, 4)


def test_score_excludes_equivalent_mutants_and_checks_the_floor():
    s = Score("k", "kernels.py", 95.0, population=200, planned=40, run=40, killed=37, equivalent=1)
    assert s.non_equivalent == 39
    assert s.percent == pytest.approx(100 * 37 / 39)
    assert s.below_floor
    assert mutation.floor_failures([s]) == ["kernels.py: 94.9% killed, below its floor of 95%"]
    ok = dataclasses.replace(s, killed=38)
    assert not ok.below_floor and mutation.floor_failures([ok]) == []
    empty = Score("g", "gate.py", 90.0, 0, 0)
    assert empty.percent is None and not empty.below_floor


def _mutants(n, target="t"):
    return [
        mutation.Mutant(target, "f.py", "op", i, i + 1, 0, (i + 1, 1), None, f"{target}{i}") for i in range(n)
    ]


def test_sample_is_per_file_and_reproducible():
    everything = _mutants(50, "a") + _mutants(5, "b")
    first = mutation.sample(everything, 10, seed=3)
    assert [m.key for m in first] == [m.key for m in mutation.sample(list(reversed(everything)), 10, seed=3)]
    assert sum(m.target == "a" for m in first) == 10 and sum(m.target == "b" for m in first) == 5
    assert [m.key for m in first] != [m.key for m in mutation.sample(everything, 10, seed=4)]
    assert len(mutation.sample(everything, None, seed=0)) == 55


def test_config_declares_a_floor_and_a_kill_command_for_every_target():
    config = mutation.load_config(ROOT)
    floors = {t.file: t.floor for t in config.targets.values()}
    assert floors["src/rmsnorm_kernel/kernels.py"] >= 95 and floors["src/rmsnorm_kernel/launch.py"] >= 95
    assert floors["src/rmsnorm_kernel/ops.py"] >= 90 and floors["src/rmsnorm_suite/gate.py"] >= 90
    for device in ("cpu", "gpu"):
        for t in config.targets.values():
            assert mutation.kill_steps(config, device, t.kill)


def test_enumeration_skips_tuning_constants_and_keeps_keys_stable():
    pytest.importorskip("cosmic_ray")
    config = mutation.load_config(ROOT)
    config = dataclasses.replace(config, targets={"launch": config.targets["launch"]})
    mutants, skipped = mutation.enumerate_mutants(config, ROOT)
    source = (ROOT / "src/rmsnorm_kernel/launch.py").read_text().splitlines()
    assert skipped["launch"]["assignment"] > 0
    assert not any(source[m.line - 1].startswith(("FORWARD_WALK_WARPS", "FUSED_PER_SM")) for m in mutants)
    assert len({m.key for m in mutants}) == len(mutants)
    again, _ = mutation.enumerate_mutants(config, ROOT)
    assert [m.key for m in again] == [m.key for m in mutants]


def test_a_run_can_be_confined_to_named_functions():
    pytest.importorskip("cosmic_ray")
    config = mutation.restrict_to_definitions(mutation.load_config(ROOT), ["_rsqrt_newton"], ROOT)
    assert list(config.targets) == ["kernels"] and config.targets["kernels"].definitions == ("_rsqrt_newton",)
    mutants, _ = mutation.enumerate_mutants(config, ROOT)
    assert mutants and {m.definition for m in mutants} == {"_rsqrt_newton"}
    assert all(m.gpu_only for m in mutants)
    for name in ("not_a_function", "cast_impl"):  # unknown; not mutated (skip_definitions)
        with pytest.raises(MutationError, match=f"--definition: .*{name}"):
            mutation.restrict_to_definitions(mutation.load_config(ROOT), ["_rsqrt_newton", name], ROOT)


def test_a_confined_session_names_its_functions_in_its_heading():
    for confined, heading in [
        (["_rsqrt_newton"], "GPU session (kernels; only _rsqrt_newton)"),
        (None, "GPU session (kernels)"),
    ]:
        meta = {"device": "gpu", "targets": ["kernels"], "confined": confined}
        result = mutation.SessionResult(Path("s"), meta, [], [], [], [], [], 0)
        assert mutation._session_name(result) == heading


def test_the_gpu_kill_commands_run_the_tests_that_reach_gpu_only_code():
    """A function only a GPU run mutates names the test that kills its mutants; the target's GPU
    kill command must collect that test, or every such mutant survives (or is never judged)."""
    config = mutation.load_config(ROOT)
    for t in config.targets.values():
        for function, why in t.gpu_only.items():
            named = re.search(r"\((tests/\w+\.py), (test_\w+)\)", why)
            assert named, (
                f"targets.{t.name}.gpu_only.{function}: name the killing test as (tests/FILE.py, TEST)"
            )
            collected = ""
            for step in mutation.kill_steps(config, "gpu", t.kill):
                out = subprocess.run(
                    [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *step["args"]],
                    cwd=ROOT, capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"},
                )  # fmt: skip
                collected += out.stdout
            assert f"{named[1]}::{named[2]}[" in collected or f"{named[1]}::{named[2]}\n" in collected, (
                f"kill.gpu.{t.kill} does not collect {named[1]}::{named[2]} ({function})"
            )


def test_an_unknown_skipped_assignment_is_an_error():
    with pytest.raises(MutationError, match="NOT_THERE"):
        mutation._assignment_lines("A = 1\n", {"NOT_THERE": "why"})


def test_report_shows_scores_catalogue_and_every_survivor():
    config = mutation.load_config(ROOT)
    patches = mutation.load_catalogue(ROOT)
    meta = {"device": "cpu", "sample": 30, "seed": 1, "hashes": {"k.py": "abc"}, "elapsed_s": 12.0,
            "gpu_only": {"kernels": 7}}  # fmt: skip
    scores = [
        Score("kernels", "src/rmsnorm_kernel/kernels.py", 95.0, 400, 30, run=30, killed=28, equivalent=1)
    ]
    survivors = [
        {"key": "k1", "file": "k.py", "line": 3, "operator": "core/NumberReplacer", "definition": "f",
         "diff": ["-    a = 1", "+    a = 2"], "why": "a tuning constant"},
        {"key": "k2", "file": "k.py", "line": 9, "operator": "core/AddNot", "definition": "g",
         "diff": ["-    if x:", "+    if not x:"], "why": None},
    ]  # fmt: skip
    catalogue = [{"id": "tile-denominator", "path": "tile", "failure": "wrong denominator", "outcome": "killed",
                  "seconds": 4.0}]  # fmt: skip
    revived = [{"key": "k3", "file": "k.py", "line": 12, "operator": "core/NumberReplacer", "definition": "h",
                "diff": ["-    b = 3", "+    b = 4"], "why": None}]  # fmt: skip
    result = mutation.SessionResult(Path("s"), meta, scores, catalogue, survivors, revived, [4.0, 6.0], 0)
    text = mutation.render_report([result], config, patches)
    row = next(line for line in text.splitlines() if line.startswith("| `src/rmsnorm_kernel/kernels.py`"))
    assert "| 30 | 28 | 1 |" in row and "96.6%" in row
    lo, hi = (100 * v for v in mutation.wilson_interval(28, 29))
    assert f"{lo:.1f}-{hi:.1f}%" in row
    assert "`tile-denominator` | killed" in text
    assert "a tuning constant" in text and "**unexplained" in text
    assert "7 mutants of kernels" in text
    assert "killed on the rerun" in text and "`k3` k.py:12" in text
    assert "FORWARD_WALK_WARPS" in text and "core/ExceptionReplacer" in text
    assert not math.isnan(float(row.split("|")[2]))


def test_report_names_the_session_that_killed_another_sessions_survivor():
    """A survivor of one session that a later session of the same report killed is shown as such,
    not as a gap; one killed nowhere stays unexplained."""
    config = mutation.load_config(ROOT)
    meta = {"sample": 25, "seed": 1, "hashes": {}, "elapsed_s": 1.0}
    survivors = [
        {"key": key, "file": "g.py", "line": 1, "operator": "core/AddNot", "definition": "f",
         "diff": ["-    if x:", "+    if not x:"], "why": None}
        for key in ("k1", "k2")
    ]  # fmt: skip
    gpu = mutation.SessionResult(Path("g"), {**meta, "device": "gpu"}, [], [], survivors, [], [1.0], 0)
    cpu_meta = {**meta, "device": "cpu", "targets": ["gate"]}
    cpu = mutation.SessionResult(Path("c"), cpu_meta, [], [], [], [], [1.0], 0, ("k1",))
    text = mutation.render_report([gpu, cpu], config, [])
    line = {key: next(ln for ln in text.splitlines() if ln.startswith(f"- `{key}`")) for key in ("k1", "k2")}
    assert "killed in the CPU session (gate) of this report" in line["k1"]
    assert "**unexplained" in line["k2"]


TOY_CONFIG = """
[run]
timeout_factor = 20.0
timeout_min_s = 60.0
tree = ["src", "tests"]
[operators]
include = ['core/ReplaceBinaryOperator_Add_(Sub|Mul)']
[targets.toy]
file = "src/toy.py"
floor = 90.0
kill = "toy"
[kill.cpu]
toy = [{ args = ["tests/test_toy.py"] }]
"""
TOY_CATALOGUE = """
[[patch]]
id = "toy-wrong-sum"
failure = "wrong sum"
path = "toy"
file = "src/toy.py"
old = "return a + b"
new = "return a + b + 1"
"""


def toy_project(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "mutation").mkdir()
    (root / "src" / "toy.py").write_text(
        "def add(a, b):\n    return a + b\n\n\ndef unused(x):\n    return x + 1\n"
    )
    (root / "tests" / "test_toy.py").write_text(
        "from toy import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    (root / "mutation" / "config.toml").write_text(TOY_CONFIG)
    (root / "mutation" / "catalogue.toml").write_text(TOY_CATALOGUE)
    return root


def test_a_session_runs_kills_records_and_resumes_in_a_copy_of_the_tree(tmp_path):
    pytest.importorskip("cosmic_ray")
    root = toy_project(tmp_path / "project")
    source = (root / "src" / "toy.py").read_text()
    config, patches = mutation.load_config(root), mutation.load_catalogue(root)
    db = tmp_path / "session.sqlite"
    meta = mutation.init_session(db, config, patches, "cpu", None, 0, root)
    assert meta["population"] == {"toy": 4}  # two + in two functions, each to - and *
    counts = mutation.execute(
        db, config, patches, "cpu", 1, None, root, work_dir=tmp_path, log=lambda _: None
    )
    assert counts["done"] == 5 and counts["pending"] == 0
    assert (root / "src" / "toy.py").read_text() == source  # the checkout is never mutated
    result = mutation.summarise(db, config, patches, {})
    (score,) = result.scores
    assert (score.run, score.killed) == (4, 2)  # unused() is not tested: both its mutants survive
    assert [s["definition"] for s in result.survivors] == ["unused", "unused"]
    assert result.catalogue[0]["outcome"] == "killed"
    assert len(result.seconds) == 5 and all(s > 0 for s in result.seconds)
    # Arguing one survivor equivalent takes it out of the denominator.
    equivalent = {result.survivors[0]["key"]: {"why": "x"}}
    assert mutation.summarise(db, config, patches, equivalent).scores[0].non_equivalent == 3
    gap = {result.survivors[0]["key"]: {"why": "a known gap", "equivalent": False}}
    explained = mutation.summarise(db, config, patches, gap)
    assert explained.scores[0].non_equivalent == 4 and "Not equivalent" in explained.survivors[0]["why"]
    assert mutation.reopen_survivors(db) == 2  # a rerun after new kill tests: pending again
    assert mutation.summarise(db, config, patches, {}).pending == 2
    assert len(mutation.read_meta(db)["retried"]) == 2
    # The same arguments resume the session; changed sources refuse it.
    assert mutation.init_session(db, config, patches, "cpu", None, 0, root)["population"] == {"toy": 4}
    with pytest.raises(MutationError, match="--fresh"):  # the same, confined (--definition)
        mutation.init_session(db, config, patches, "cpu", None, 0, root, confined=["unused"])
    (root / "src" / "toy.py").write_text(source + "\n")
    with pytest.raises(MutationError, match="--fresh"):
        mutation.init_session(db, config, patches, "cpu", None, 0, root)


def test_a_kill_command_that_fails_unmutated_leaves_its_mutants_pending(tmp_path):
    pytest.importorskip("cosmic_ray")
    root = toy_project(tmp_path / "project")
    (root / "tests" / "test_toy.py").write_text("def test_broken():\n    assert False\n")
    config, patches = mutation.load_config(root), mutation.load_catalogue(root)
    db = tmp_path / "session.sqlite"
    mutation.init_session(db, config, patches, "cpu", None, 0, root)
    counts = mutation.execute(
        db, config, patches, "cpu", 1, None, root, work_dir=tmp_path, log=lambda _: None
    )
    assert counts["broken"] == ["toy"] and counts["done"] == 0 and counts["pending"] == 5
    result = mutation.summarise(db, config, patches, {})
    assert "fails without a mutant" in result.meta["baseline_errors"]["toy"]
    assert mutation._verdict([result]) == 1
    assert "Kill command `toy` fails on the unmutated tree" in mutation.render_report(
        [result], config, patches
    )
