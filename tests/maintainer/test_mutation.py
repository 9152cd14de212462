"""The mutation runner's own logic (maintainer.mutation), on CPU and without running a
mutant: the catalogue applies exactly once, the score and its interval, the floor check, the
sample, and the report. The mutation run itself is `nox -s mutation`."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from maintainer.mutation.catalogue import Patch, apply_patch, check_catalogue, load_catalogue
from maintainer.mutation.cli import _verdict
from maintainer.mutation.config import MutationError, load_config
from maintainer.mutation.equivalence import current_equivalent, equivalence_problems, load_equivalent
from maintainer.mutation.population import (
    Mutant,
    _assignment_lines,
    describe_mutant,
    enumerate_mutants,
    restrict_to_definitions,
    sample,
)
from maintainer.mutation.report import SessionResult, _session_name, render_report, summarise
from maintainer.mutation.runner import execute, kill_steps
from maintainer.mutation.scores import Score, floor_failures, wilson_interval
from maintainer.mutation.session import (
    cosmic_ray_version,
    file_hashes,
    init_session,
    read_meta,
    reopen_survivors,
)

ROOT = Path(__file__).resolve().parents[2]


def test_every_catalogue_patch_applies_exactly_once_to_the_current_code():
    patches = load_catalogue(ROOT)
    check_catalogue(patches, ROOT)
    paths = {p.path for p in patches}
    assert {"tile", "EVEN", "two-walk", "wide", "cooperative"} <= paths


def test_a_patch_whose_old_text_is_missing_or_repeated_is_an_error():
    patch = Patch("p", "wrong denominator", "tile", "k.py", "/ N", "/ BLOCK_N")
    assert apply_patch("a / N + eps", patch) == "a / BLOCK_N + eps"
    with pytest.raises(MutationError, match="occurs 0 times"):
        apply_patch("a / M", patch)
    with pytest.raises(MutationError, match="occurs 2 times"):
        apply_patch("a / N + b / N", patch)


def test_catalogue_entries_are_checked(tmp_path):
    (tmp_path / "maintainer" / "mutation").mkdir(parents=True)
    (tmp_path / "k.py").write_text("x = a / N\n")
    cat = tmp_path / "maintainer" / "mutation" / "catalogue.toml"
    entry = '[[patch]]\nid = "a"\nfailure = "f"\npath = "tile"\nfile = "k.py"\nold = "/ N"\nnew = "/ ("\n'
    cat.write_text(entry)
    with pytest.raises(MutationError, match="invalid Python"):
        check_catalogue(load_catalogue(tmp_path), tmp_path)
    cat.write_text(entry + entry)
    with pytest.raises(MutationError, match="appears twice"):
        load_catalogue(tmp_path)
    cat.write_text('[[patch]]\nid = "a"\nfile = "k.py"\n')
    with pytest.raises(MutationError, match="lacks failure, path, old, new"):
        load_catalogue(tmp_path)


@pytest.mark.parametrize(
    ("killed", "total", "low", "high"),
    # Wilson 95% intervals (z = 1.95996), as scipy.stats.binomtest(k, n).proportion_ci("wilson") gives
    [(27, 30, 0.7438, 0.9654), (30, 30, 0.8865, 1.0), (0, 10, 0.0, 0.2775), (95, 100, 0.8883, 0.9785)],
)
def test_wilson_interval(killed, total, low, high):
    lo, hi = wilson_interval(killed, total)
    assert lo == pytest.approx(low, abs=1e-4) and hi == pytest.approx(high, abs=1e-4)


def test_wilson_interval_agrees_with_scipy():
    stats = pytest.importorskip("scipy.stats")
    for k, n in [(1, 7), (40, 43), (12, 12)]:
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        lo, hi = wilson_interval(k, n)
        assert lo == pytest.approx(ci.low, abs=1e-9) and hi == pytest.approx(ci.high, abs=1e-9)


def test_wilson_interval_rejects_impossible_counts():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="killed"):
        wilson_interval(5, 4)


def test_score_excludes_equivalent_mutants_and_checks_the_floor():
    s = Score("k", "kernels.py", 95.0, population=200, planned=40, run=40, killed=37, equivalent=1)
    assert s.non_equivalent == 39
    assert s.percent == pytest.approx(100 * 37 / 39)
    assert s.below_floor
    assert floor_failures([s]) == ["kernels.py: 94.9% killed, below its floor of 95%"]
    ok = dataclasses.replace(s, killed=38)
    assert not ok.below_floor and floor_failures([ok]) == []
    empty = Score("g", "gate.py", 90.0, 0, 0)
    assert empty.percent is None and not empty.below_floor


def _mutants(n, target="t"):
    return [Mutant(target, "f.py", "op", i, i + 1, 0, (i + 1, 1), None, f"{target}{i}") for i in range(n)]


def test_sample_is_per_file_and_reproducible():
    everything = _mutants(50, "a") + _mutants(5, "b")
    first = sample(everything, 10, seed=3)
    assert [m.key for m in first] == [m.key for m in sample(list(reversed(everything)), 10, seed=3)]
    assert sum(m.target == "a" for m in first) == 10 and sum(m.target == "b" for m in first) == 5
    assert [m.key for m in first] != [m.key for m in sample(everything, 10, seed=4)]
    assert len(sample(everything, None, seed=0)) == 55


def test_config_declares_a_floor_and_a_kill_command_for_every_target():
    config = load_config(ROOT)
    floors = {t.file: t.floor for t in config.targets.values()}
    assert floors["src/rmsnorm_kernel/kernels.py"] >= 95 and floors["src/rmsnorm_kernel/launch.py"] >= 95
    assert floors["src/rmsnorm_kernel/ops.py"] >= 90 and floors["src/rmsnorm_suite/gate.py"] >= 90
    for device in ("cpu", "gpu"):
        for t in config.targets.values():
            assert kill_steps(config, device, t.kill)


def test_enumeration_skips_tuning_constants_and_keeps_keys_stable():
    pytest.importorskip("cosmic_ray")
    config = load_config(ROOT)
    config = dataclasses.replace(config, targets={"launch": config.targets["launch"]})
    mutants, skipped = enumerate_mutants(config, ROOT)
    source = (ROOT / "src/rmsnorm_kernel/launch.py").read_text().splitlines()
    assert skipped["launch"]["assignment"] > 0
    assert not any(
        source[m.line - 1].lstrip().startswith(("FORWARD_WALK_WARPS", "FUSED_PER_SM")) for m in mutants
    )
    assert len({m.key for m in mutants}) == len(mutants)
    again, _ = enumerate_mutants(config, ROOT)
    assert [m.key for m in again] == [m.key for m in mutants]


def test_a_run_can_be_confined_to_named_functions():
    pytest.importorskip("cosmic_ray")
    config = restrict_to_definitions(load_config(ROOT), ["_rsqrt_newton"], ROOT)
    assert list(config.targets) == ["kernels"] and config.targets["kernels"].definitions == ("_rsqrt_newton",)
    mutants, _ = enumerate_mutants(config, ROOT)
    assert mutants and {m.definition for m in mutants} == {"_rsqrt_newton"}
    assert all(m.gpu_only for m in mutants)
    for name in ("not_a_function", "cast_impl"):  # unknown; not mutated (skip_definitions)
        with pytest.raises(MutationError, match=f"--definition: .*{name}"):
            restrict_to_definitions(load_config(ROOT), ["_rsqrt_newton", name], ROOT)


def test_a_confined_session_names_its_functions_in_its_heading():
    for confined, heading in [
        (["_rsqrt_newton"], "GPU session (kernels; only _rsqrt_newton)"),
        (None, "GPU session (kernels)"),
    ]:
        meta = {"device": "gpu", "targets": ["kernels"], "confined": confined}
        result = SessionResult(Path("s"), meta, [], [], [], [], [], 0)
        assert _session_name(result) == heading


def test_the_gpu_kill_commands_run_the_tests_that_reach_gpu_only_code():
    """A function only a GPU run mutates names the test that kills its mutants; the target's GPU
    kill command must collect that test, or every such mutant survives (or is never judged)."""
    config = load_config(ROOT)
    for t in config.targets.values():
        for function, why in t.gpu_only.items():
            named = re.search(r"\((tests/[\w/]+\.py), (test_\w+)\)", why)
            assert named, (
                f"targets.{t.name}.gpu_only.{function}: name the killing test as (tests/DIR/FILE.py, TEST)"
            )
            collected = ""
            for step in kill_steps(config, "gpu", t.kill):
                out = subprocess.run(
                    [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *step["args"]],
                    cwd=ROOT, capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"},
                )  # fmt: skip
                collected += out.stdout
            assert f"{named[1]}::{named[2]}[" in collected or f"{named[1]}::{named[2]}\n" in collected, (
                f"kill.gpu.{t.kill} does not collect {named[1]}::{named[2]} ({function})"
            )


def test_skipped_assignments_include_a_module_level_class_s_fields():
    """A skipped name matches a module-level assignment or a field of a module-level class (the
    launch tuning is a frozen dataclass): every line of a multi-line default; nothing nested
    deeper, nor another name."""
    source = (
        "A = 1\n"
        "class Tuning:\n"
        "    B: int = 2\n"
        "    C: dict = field(\n"
        "        default_factory=dict\n"
        "    )\n"
        "    D = 4\n"
        "def f():\n"
        "    B = 5\n"
    )
    assert _assignment_lines(source, {"A": "", "B": "", "C": ""}) == {1: "A", 3: "B", 4: "C", 5: "C", 6: "C"}
    with pytest.raises(MutationError, match="E"):
        _assignment_lines(source, {"B": "", "E": ""})


def test_the_launch_tuning_fields_are_skipped():
    """Every speed-only field of launch.Tuning named in the config is skipped: no mutant of the
    launch target sits on its lines."""
    pytest.importorskip("cosmic_ray")
    config = load_config(ROOT)
    target = config.targets["launch"]
    source = (ROOT / target.file).read_text()
    lines = _assignment_lines(source, target.skip_assignments)
    assert {"FORWARD_TILE", "BACKWARD_TILE", "EVEN_MAX_ROWS", "FUSED_PER_SM"} <= set(lines.values())
    mutants, _ = enumerate_mutants(dataclasses.replace(config, targets={"launch": target}), ROOT)
    assert not [m for m in mutants if m.line in lines]


def test_an_unknown_skipped_assignment_is_an_error():
    with pytest.raises(MutationError, match="NOT_THERE"):
        _assignment_lines("A = 1\n", {"NOT_THERE": "why"})


def test_report_shows_scores_catalogue_and_every_survivor():
    config = load_config(ROOT)
    patches = load_catalogue(ROOT)
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
    result = SessionResult(Path("s"), meta, scores, catalogue, survivors, revived, [4.0, 6.0], 0)
    text = render_report([result], config, patches)
    row = next(line for line in text.splitlines() if line.startswith("| `src/rmsnorm_kernel/kernels.py`"))
    assert "| 30 | 28 | 1 |" in row and "96.6%" in row
    lo, hi = (100 * v for v in wilson_interval(28, 29))
    assert f"{lo:.1f}-{hi:.1f}%" in row
    assert "`tile-denominator` | killed" in text
    assert "a tuning constant" in text and "**unexplained" in text
    assert "7 mutants of kernels" in text
    assert "killed on the rerun" in text and "`k3` k.py:12" in text
    assert "FORWARD_WALK_WARPS" in text and "core/ExceptionReplacer" in text
    assert not math.isnan(float(row.split("|")[2]))


def test_a_target_counts_as_measured_on_both_devices_only_where_the_run_would_repeat():
    """gate's kill command is the same on either device and it has no GPU-only code: a CPU
    session measures it for both. kernels has GPU-only functions: its CPU session does not."""
    from maintainer.mutation.report import unmeasured
    from maintainer.mutation.session import file_hashes

    config = load_config(ROOT)
    assert config.kill["cpu"]["gate"] == config.kill["gpu"]["gate"] and not config.targets["gate"].gpu_only
    files = {t.file for t in config.targets.values()}
    meta = {"device": "cpu", "hashes": file_hashes(ROOT, files)}
    scores = [
        Score(t.name, t.file, t.floor, 10, 10)
        for t in config.targets.values()
        if t.name in ("gate", "kernels")
    ]
    missing = unmeasured([SessionResult(Path("c"), meta, scores, [], [], [], [], 0)], config, ROOT)
    assert "gate" not in missing["gpu"] and "kernels" in missing["gpu"]
    assert "gate" not in missing["cpu"] and "kernels" not in missing["cpu"] and "ops" in missing["cpu"]


def test_report_names_the_session_that_killed_another_sessions_survivor():
    """A survivor of one session that a later session of the same report killed is shown as such,
    not as a gap; one killed nowhere stays unexplained."""
    config = load_config(ROOT)
    meta = {"sample": 25, "seed": 1, "hashes": {}, "elapsed_s": 1.0}
    survivors = [
        {"key": key, "file": "g.py", "line": 1, "operator": "core/AddNot", "definition": "f",
         "diff": ["-    if x:", "+    if not x:"], "why": None}
        for key in ("k1", "k2")
    ]  # fmt: skip
    gpu = SessionResult(Path("g"), {**meta, "device": "gpu"}, [], [], survivors, [], [1.0], 0)
    cpu_meta = {**meta, "device": "cpu", "targets": ["gate"]}
    cpu = SessionResult(Path("c"), cpu_meta, [], [], [], [], [1.0], 0, ("k1",))
    text = render_report([gpu, cpu], config, [])
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
    (root / "maintainer" / "mutation").mkdir(parents=True)
    (root / "src" / "toy.py").write_text(
        "def add(a, b):\n    return a + b\n\n\ndef unused(x):\n    return x + 1\n"
    )
    (root / "tests" / "test_toy.py").write_text(
        "from toy import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    (root / "maintainer" / "mutation" / "config.toml").write_text(TOY_CONFIG)
    (root / "maintainer" / "mutation" / "catalogue.toml").write_text(TOY_CATALOGUE)
    return root


def test_a_session_runs_kills_records_and_resumes_in_a_copy_of_the_tree(tmp_path):
    pytest.importorskip("cosmic_ray")
    root = toy_project(tmp_path / "project")
    source = (root / "src" / "toy.py").read_text()
    config, patches = load_config(root), load_catalogue(root)
    db = tmp_path / "session.sqlite"
    meta = init_session(db, config, patches, "cpu", None, 0, root)
    assert meta["population"] == {"toy": 4}  # two + in two functions, each to - and *
    counts = execute(db, config, patches, "cpu", 1, None, root, work_dir=tmp_path, log=lambda _: None)
    assert counts["done"] == 5 and counts["pending"] == 0
    assert (root / "src" / "toy.py").read_text() == source  # the checkout is never mutated
    result = summarise(db, config, patches, {})
    (score,) = result.scores
    assert (score.run, score.killed) == (4, 2)  # unused() is not tested: both its mutants survive
    assert [s["definition"] for s in result.survivors] == ["unused", "unused"]
    assert result.catalogue[0]["outcome"] == "killed"
    assert len(result.seconds) == 5 and all(s > 0 for s in result.seconds)
    # Arguing one survivor equivalent takes it out of the denominator.
    equivalent = {result.survivors[0]["key"]: {"why": "x"}}
    assert summarise(db, config, patches, equivalent).scores[0].non_equivalent == 3
    gap = {result.survivors[0]["key"]: {"why": "a known gap", "equivalent": False}}
    explained = summarise(db, config, patches, gap)
    assert explained.scores[0].non_equivalent == 4 and "Not equivalent" in explained.survivors[0]["why"]
    assert reopen_survivors(db, [result.catalogue[0]["id"]]) == 0  # killed: not a survivor
    assert reopen_survivors(db, [result.survivors[0]["key"]]) == 1  # one named survivor
    assert summarise(db, config, patches, {}).pending == 1
    assert reopen_survivors(db) == 1  # a rerun after new kill tests: every survivor pending again
    assert summarise(db, config, patches, {}).pending == 2
    assert len(read_meta(db)["retried"]) == 2
    # The same arguments resume the session; changed sources refuse it.
    assert init_session(db, config, patches, "cpu", None, 0, root)["population"] == {"toy": 4}
    with pytest.raises(MutationError, match="--fresh"):  # the same, confined (--definition)
        init_session(db, config, patches, "cpu", None, 0, root, confined=["unused"])
    (root / "src" / "toy.py").write_text(source + "\n")
    with pytest.raises(MutationError, match="--fresh"):
        init_session(db, config, patches, "cpu", None, 0, root)


def test_a_kill_command_that_fails_unmutated_leaves_its_mutants_pending(tmp_path):
    pytest.importorskip("cosmic_ray")
    root = toy_project(tmp_path / "project")
    (root / "tests" / "test_toy.py").write_text("def test_broken():\n    assert False\n")
    config, patches = load_config(root), load_catalogue(root)
    db = tmp_path / "session.sqlite"
    init_session(db, config, patches, "cpu", None, 0, root)
    counts = execute(db, config, patches, "cpu", 1, None, root, work_dir=tmp_path, log=lambda _: None)
    assert counts["broken"] == ["toy"] and counts["done"] == 0 and counts["pending"] == 5
    result = summarise(db, config, patches, {})
    assert "fails without a mutant" in result.meta["baseline_errors"]["toy"]
    assert _verdict([result]) == 1
    assert "Kill command `toy` fails on the unmutated tree" in render_report([result], config, patches)


def test_every_equivalence_entry_names_the_mutant_its_reason_argues():
    """Each key of maintainer/mutation/equivalent.toml names a mutant of the population the committed config
    draws, and that mutant is the one the entry describes (file, operator, function, its line
    before and after the change, the next line): else the reason excuses another mutant."""
    config = load_config(ROOT)
    equivalent = load_equivalent(ROOT)
    assert equivalent, "maintainer/mutation/equivalent.toml holds no entry"
    assert equivalence_problems(config, equivalent, ROOT) == {}
    for key, entry in equivalent.items():
        assert entry.get("why") and entry.get("mutant"), f"{key}: an entry needs its change and its reason"


def test_an_equivalence_key_that_comes_to_name_another_mutant_is_caught(tmp_path):
    """The same line twice in one function: keys K and K-1 in order. A copy of the line added
    above the argued one takes K; the entry's description then disagrees and it excuses nothing.
    A key whose line is gone names no mutant."""
    root = toy_project(tmp_path / "project")
    source = "def unused(x):\n    y = x + 1\n    return y\n"
    (root / "src" / "toy.py").write_text(source)
    config = load_config(root)
    (argued,) = [m for m in enumerate_mutants(config, root)[0] if m.operator.endswith("Add_Sub")]
    entry = {"why": "x", **describe_mutant(argued, root)}
    assert entry["mutated"] == "y = x - 1" and entry["after"] == "return y"
    assert equivalence_problems(config, {argued.key: entry}, root) == {}
    assert current_equivalent(config, {argued.key: entry}, root, log=print) == {argued.key: entry}

    (root / "src" / "toy.py").write_text(
        "def unused(x):\n    y = x + 1\n    print(y)\n    y = x + 1\n    return y\n"
    )
    problems = equivalence_problems(config, {argued.key: entry}, root)
    assert "after is 'print(y)'" in problems[argued.key]
    moved = {f"{argued.key}-1": entry}  # the entry under the key its mutant has now
    assert equivalence_problems(config, moved, root) == {}
    logged = []
    assert current_equivalent(config, {argued.key: entry}, root, log=logged.append) == {}
    assert logged and "not counted as equivalent" in logged[0]

    (root / "src" / "toy.py").write_text("def unused(x):\n    return x\n")
    problems = equivalence_problems(config, {argued.key: entry}, root)
    assert "names no mutant" in problems[argued.key]


def _published_sessions(text: str) -> list[dict]:
    """docs/mutation.md's sessions: device, confined functions, the hashes of the files measured
    and each row's (file, target, population)."""
    sessions = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        heading = re.match(r"(CPU|GPU) session \(([^;)]*)(?:; only ([^)]*))?\)", section)
        if not heading:
            continue
        rows = re.findall(r"^\| `([^`]+)` \((\w+)\) \| (\d+) \|", section, flags=re.M)
        sessions.append({
            "device": heading[1].lower(),
            "confined": heading[3].split(", ") if heading[3] else None,
            "hashes": dict(re.findall(r"`([^`]+)` ([0-9a-f]{16})", section.split("\n\n", 2)[1])),
            "rows": [(f, t, int(n)) for f, t, n in rows],
        })  # fmt: skip
    return sessions


def test_the_published_populations_are_what_the_committed_config_draws():
    """Every population docs/mutation.md publishes for a file that has not changed since is the
    one the committed config draws from it now, with the pinned cosmic-ray: so `--seed` redraws
    the published sample. A file changed since shows as such in the page, and is not checked."""
    config = load_config(ROOT)
    sessions = _published_sessions((ROOT / "docs" / "mutation.md").read_text(encoding="utf-8"))
    assert sessions and all(s["rows"] for s in sessions), "no session table found in docs/mutation.md"
    checked = 0
    for s in sessions:
        for file, target, published in s["rows"]:
            if s["hashes"].get(file) != file_hashes(ROOT, {file})[file]:
                continue  # a stale score, shown as "changed since"
            drawn = config if s["confined"] is None else restrict_to_definitions(config, s["confined"], ROOT)
            drawn = dataclasses.replace(drawn, targets={target: drawn.targets[target]})
            mutants, _ = enumerate_mutants(drawn, ROOT)
            population = sum(s["device"] == "gpu" or not m.gpu_only for m in mutants)
            assert published == population, (
                f"docs/mutation.md: {s['device']} {target}: {published} mutants published, the committed "
                f"config draws {population} with cosmic-ray {cosmic_ray_version()}"
            )
            checked += 1
    print(f"{checked} published populations checked")


def test_a_report_marks_stale_scores_and_the_targets_not_measured_at_this_commit(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    config = load_config(ROOT)
    config = dataclasses.replace(
        config,
        targets={
            n: dataclasses.replace(t, file="a.py") for n, t in config.targets.items() if n in ("ops", "gate")
        },
    )
    now = file_hashes(tmp_path, {"a.py"})["a.py"]
    meta = {"device": "cpu", "sample": 30, "seed": 1, "hashes": {"a.py": now}, "elapsed_s": 1.0,
            "started": "2026-12-04", "commit": "abc123", "config": "f" * 16, "cosmic_ray": "8.7.0"}  # fmt: skip
    scores = [Score("ops", "a.py", 90.0, 10, 10, run=10, killed=10)]
    result = SessionResult(Path("s"), meta, scores, [], [], [], [1.0], 0)
    text = render_report([result], config, [], tmp_path)
    assert "abc123" not in text and "cosmic-ray 8.7.0" in text  # the machine's checkout: not the code's
    assert "| 0 | unchanged | no commit |" in text  # a.py is in no commit
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "a.py"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "a"], cwd=tmp_path, check=True)
    first = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True
    )
    (tmp_path / "b.py").write_text("y = 1\n")  # a later commit that leaves a.py alone
    subprocess.run([*git, "add", "b.py"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "b"], cwd=tmp_path, check=True)
    text = render_report([result], config, [], tmp_path)
    assert f"| 0 | unchanged | `{first.stdout.strip()}` |" in text
    assert "gate: not yet measured on CPU at this commit" in text
    assert "ops, gate: not yet measured on GPU at this commit" in text
    (tmp_path / "a.py").write_text("x = 2\n")
    text = render_report([result], config, [], tmp_path)
    assert "| 0 | **changed since** |" in text and "ops, gate: not yet measured on CPU" in text


def two_target_project(root: Path) -> Path:
    toy_project(root)
    (root / "src" / "other.py").write_text("def sub(a, b):\n    return a + b - 2 * b\n")
    (root / "tests" / "test_other.py").write_text(
        "from other import sub\n\n\ndef test_sub():\n    assert sub(5, 3) == 2\n"
    )
    other = '[targets.other]\nfile = "src/other.py"\nfloor = 90.0\nkill = "other"\n[kill.cpu]\n'
    config = TOY_CONFIG.replace("[kill.cpu]\n", other) + 'other = [{ args = ["tests/test_other.py"] }]\n'
    (root / "maintainer" / "mutation" / "config.toml").write_text(config)
    return root


def _only(config, *names):
    return dataclasses.replace(config, targets={k: v for k, v in config.targets.items() if k in names})


def test_narrowing_keeps_the_unchanged_targets_results_and_drops_the_rest(tmp_path):
    pytest.importorskip("cosmic_ray")
    root = two_target_project(tmp_path / "project")
    config, patches = load_config(root), load_catalogue(root)
    assert sorted(config.targets) == ["other", "toy"]
    db = tmp_path / "session.sqlite"
    init_session(db, config, patches, "cpu", None, 0, root)
    execute(db, config, patches, "cpu", 1, None, root, work_dir=tmp_path, log=lambda _: None)
    before = summarise(db, config, patches, {})
    toy_done = {s.file: (s.run, s.killed) for s in before.scores}["src/toy.py"]
    (root / "src" / "other.py").write_text("def sub(a, b):\n    return a - b\n")  # other changed
    toy = _only(config, "toy")
    with pytest.raises(MutationError, match="--narrow"):  # not without asking
        init_session(db, toy, patches, "cpu", None, 0, root)
    meta = init_session(db, toy, patches, "cpu", None, 0, root, narrow=True)
    assert meta["targets"] == ["toy"] and meta["narrowed"]["from"] == ["other", "toy"]
    assert set(meta["population"]) == {"toy"} and {m["target"] for m in meta["mutants"].values()} == {"toy"}
    after = summarise(db, toy, patches, {})
    assert [(s.file, s.run, s.killed) for s in after.scores] == [("src/toy.py", *toy_done)]
    assert after.pending == 0
    # The narrowed session resumes as a plain toy session; a changed kept file is refused.
    assert init_session(db, toy, patches, "cpu", None, 0, root)["targets"] == ["toy"]
    with pytest.raises(MutationError, match="--fresh"):
        init_session(db, _only(config, "other"), [], "cpu", None, 0, root, narrow=True)


def test_a_resumed_run_rechecks_its_recorded_baseline_beside_the_mutants(tmp_path):
    pytest.importorskip("cosmic_ray")
    root = toy_project(tmp_path / "project")
    config, patches = load_config(root), load_catalogue(root)
    db = tmp_path / "session.sqlite"
    init_session(db, config, patches, "cpu", None, 0, root)
    execute(db, config, patches, "cpu", 1, None, root, work_dir=tmp_path, log=lambda _: None)
    assert set(read_meta(db)["baselines"]) == {"toy"}
    assert reopen_survivors(db) == 2
    # The recorded baseline passes again: the rerun's results stand.
    counts = execute(db, config, patches, "cpu", 1, None, root, work_dir=tmp_path, log=lambda _: None)
    assert counts["done"] == 2 and counts["pending"] == 0
    assert reopen_survivors(db) == 2
    # Now the unmutated tree fails its kill command: what this run judged is dropped, not kept.
    (root / "tests" / "test_toy.py").write_text(
        "from toy import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n    assert False\n"
    )
    counts = execute(db, config, patches, "cpu", 1, None, root, work_dir=tmp_path, log=lambda _: None)
    assert counts["done"] == 0 and counts["pending"] == 2 and counts["broken"] == ["toy"]
    result = summarise(db, config, patches, {})
    assert result.pending == 2 and "toy" in result.meta["baseline_errors"]
    assert "toy" not in read_meta(db)["baselines"]


def test_a_reports_error_excerpt_names_no_machine_path():
    from maintainer.mutation.report import _scrub

    text = (
        'File "/opt/a/.venv/lib/python3.12/site-packages/triton/interpreter.py", line 1\n'
        "args=['/usr/local/bin/python3.12', '-m'] /tmp/rmsnorm-mutation-ab_1/tree3/tests/op/t.py:5"
    )
    assert _scrub(text) == (
        "File \"site-packages/triton/interpreter.py\", line 1\nargs=['python3.12', '-m'] tests/op/t.py:5"
    )


def test_every_hand_written_mutant_applies_once_and_the_report_shows_its_record(tmp_path):
    from maintainer.mutation import handwritten

    entries = handwritten.load_handwritten(ROOT)
    assert {
        "dh-row-stride-tile",
        "residual-same-numel",
        "dx-store-past-row",
        "eps-outside-rsqrt-composite",
    } <= {h.id for h in entries}
    config = load_config(ROOT)
    for h in entries:
        text = handwritten.mutated(h, ROOT)
        if h.file.endswith(".py"):
            compile(text, h.file, "exec")
        assert h.args or h.kill in config.kill["cpu"], h
    assert any(h.file.endswith(".cpp") and h.args for h in entries)  # the compiled host path's C++
    # The report: the outcome recorded, stale once the file changes, "not run" without a record.
    (tmp_path / "maintainer" / "mutation").mkdir(parents=True)
    (tmp_path / "maintainer" / "mutation" / "handwritten.toml").write_text(
        '[[mutant]]\nid = "m"\nclass = "c"\nfile = "a.py"\nold = "x = 1"\nnew = "x = 2"\nkill = "k"\n'
    )
    (tmp_path / "a.py").write_text("x = 1\n")
    assert "| `m` | c | `a.py` | k | **not run** |" in handwritten.render(tmp_path)
    (tmp_path / "docs" / "data").mkdir(parents=True)
    record = {"m": {"outcome": "killed", "seconds": 3.0, "kill": "k", "date": "2026-12-04",
                    "hash": file_hashes(tmp_path, {"a.py"})["a.py"]}}  # fmt: skip
    (tmp_path / "docs" / "data" / "handwritten.json").write_text(json.dumps(record))
    assert "| killed (2026-12-04, 3 s) |" in "\n".join(handwritten.render(tmp_path))
    (tmp_path / "a.py").write_text("x = 1\ny = 0\n")
    assert "**file changed since**" in "\n".join(handwritten.render(tmp_path))
    with pytest.raises(MutationError, match="occurs 0 times"):
        handwritten.mutated(dataclasses.replace(entries[0], old="no such text"), ROOT)
