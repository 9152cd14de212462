"""The results file (rmsnorm_suite.results): records round trip through one write and one load,
the committed performance run and the first harness's format still load, and a malformed file
is refused with a ValueError naming the file and the field."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rmsnorm_suite import results

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "performance-results.json"


def a_run() -> results.Run:
    """A small run by hand: a timed row with GPU time, a failed row, a copy of x."""
    whole = results.timing([1.0, 2.0, 3.0, 4.0], [1.5, 3.5], 4_000_000, 8.0)
    device = results.timing([0.5, 0.6, 0.7], [0.6], 4_000_000, 8.0)
    host = results.timing([0.05, 0.07, 0.06], [0.06], None, None)
    ok = results.Row(
        "kernel", "4x33-bfloat16", "forward_backward", "ok", 4, 33, "bfloat16", "large",
        bytes=4_000_000, errors={"dx": 1e-3, "dw": float("nan")}, whole=whole, device=device, device_reps=8,
        host=host,
    )  # fmt: skip
    failed = results.Row(
        "liger", "4x33-bfloat16", "forward", "failed", 4, 33, "bfloat16", "large",
        bytes=1_000, residual=True, error="RuntimeError: boom", device_error="not captured",
    )  # fmt: skip
    shape_copy = results.ShapeCopy(4, 33, "bfloat16", "large", 528, 0.01, 0.0528, None, None, None)
    return results.Run(
        (ok, failed),
        created="2026-12-01T00:00:00+00:00",
        machine={"device": "test", "sms": 132},
        git=results.Git("a" * 40, False),
        settings={"samples_per_block": 2, "blocks": 2, "round_indices": [0, 1]},
        copy=results.CopyCeiling(8.0, 1024, (0.1, 0.2), 0.15),
        same_bytes_copy={"4x33-bfloat16": shape_copy},
        wall_s=1.5,
        label="head",
        round=3,
    )


def test_timing_summarises_the_samples():
    t = results.timing([1.0, 2.0, 3.0, 4.0], [1.5, 3.5], 4_000_000, 8.0)
    assert t.median_ms == 2.5
    assert t.tbs == pytest.approx(4_000_000 / 2.5e-3 / 1e12) == results.bandwidth_tbs(4_000_000, 2.5)
    assert t.fraction_of_copy == pytest.approx(t.tbs / 8.0)
    # a failed row keeps its samples, without a summary; no copy ceiling: no fraction
    assert results.timing([1.0], [1.0], 10, 8.0, summarise=False) == results.Timing((1.0,), (1.0,))
    assert results.timing([1.0], [1.0], 10, None).fraction_of_copy is None
    assert results.timing([], [], 10, 8.0) == results.Timing()


def test_write_then_load_gives_the_same_records(tmp_path):
    run = a_run()
    path = results.write(run, tmp_path / "new", "head")
    assert path == tmp_path / "new" / "head.json"
    again = results.load(path)
    assert again.results[0].errors["dx"] == 1e-3 and math.isnan(again.results[0].errors["dw"])
    # NaN is not equal to itself: compare the rows with their errors left out
    assert [replace(r, errors={}) for r in again.results] == [replace(r, errors={}) for r in run.results]
    assert (again.machine, again.git, again.copy, again.same_bytes_copy) == (
        run.machine, run.git, run.copy, run.same_bytes_copy,
    )  # fmt: skip
    assert (again.label, again.round, again.round_indices, again.wall_s) == ("head", 3, [0, 1], 1.5)


def test_default_name_carries_the_commit(tmp_path):
    path = results.write(a_run(), tmp_path)
    assert path.name.startswith("bench-") and path.name.endswith(f"-{'a' * 10}.json")


def test_write_takes_records_only(tmp_path):
    with pytest.raises(TypeError, match="run must be a results.Run"):
        results.write(a_run().to_json(), tmp_path)


def test_index_and_rows_of():
    run = a_run()
    assert set(run.index()) == {
        ("kernel", "4x33-bfloat16", "forward_backward"),
        ("liger", "4x33-bfloat16", "forward"),
    }
    assert list(run.rows_of("liger")) == [("4x33-bfloat16", "forward")]
    assert run.results[0].timing("device").median_ms == 0.6 and run.results[0].ok
    assert run.results[0].timing("host").median_ms == 0.06 and run.results[0].timing("whole").median_ms == 2.5
    with pytest.raises(ValueError, match="kind must be one of"):
        run.results[0].timing("gpu")
    assert not run.results[1].ok


def test_the_committed_performance_run_loads_and_keeps_every_key():
    """docs/performance-results.json, as the harness wrote it: every key and value it has is
    written back unchanged (a key the file lacks is written with its empty value)."""
    data = json.loads(COMMITTED.read_text(encoding="utf-8"))
    run = results.load(COMMITTED)
    assert len(run.results) == len(data["results"]) > 0 and run.schema == 1
    first = data["results"][0]
    row = run.index()[first["provider"], first["shape"], first["mode"]]
    assert row.whole.median_ms == first["median_ms"] and list(row.whole.samples_ms) == first["samples_ms"]
    assert row.device.tbs == first["device_tbs"] and row.errors == first["errors"]
    assert run.copy.tbs == data["copy"]["tbs"] and run.machine["device"] == data["machine"]["device"]

    def within(have, want, where="") -> None:
        if isinstance(want, dict):
            for key, value in want.items():
                assert key in have, f"{where}.{key} dropped"
                within(have[key], value, f"{where}.{key}")
        elif isinstance(want, list):
            assert len(have) == len(want), where
            for i, (h, w) in enumerate(zip(have, want)):
                within(h, w, f"{where}[{i}]")
        else:
            assert have == want, where

    within(run.to_json(), data)


# The first harness's format (before GPU-only timing, residual rows and the copies of x): a row
# with the keys it wrote, samples cut short.
FIRST_FORMAT = {
    "schema": 1,
    "created": "2026-11-29T11:44:51+00:00",
    "machine": {"torch": "2.11.0+cu130", "triton": "3.6.0", "device": "NVIDIA H200", "sms": 132},
    "git": {"commit": None, "dirty": False},
    "settings": {"samples_per_block": 50, "blocks": 3, "warmup_ms": 25.0, "eps": 1e-06, "seed": 0},
    "copy": {"bytes": 4294967296, "samples_ms": [1.01, 1.02], "median_ms": 1.015, "tbs": 4.23},
    "results": [
        {
            "provider": "kernel",
            "shape": "32768x4096-bfloat16",
            "m": 32768,
            "n": 4096,
            "dtype": "bfloat16",
            "group": "large",
            "mode": "forward",
            "bytes": 536870912,
            "status": "ok",
            "error": None,
            "samples_ms": [0.184, 0.1348, 0.1356],
            "block_medians_ms": [0.1356, 0.1355, 0.1357],
            "errors": {"y": 0.00166},
            "median_ms": 0.1356,
            "tbs": 3.96,
            "fraction_of_copy": 0.93,
        },
    ],  # fmt: skip
    "wall_s": 52.3,
}


def test_a_file_of_the_first_format_loads(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(FIRST_FORMAT))
    run = results.load(path)
    (row,) = run.results
    assert row.whole.median_ms == 0.1356 and row.whole.block_medians_ms == (0.1356, 0.1355, 0.1357)
    assert row.device == results.Timing() and row.device_error is None and not row.residual
    assert run.same_bytes_copy == {} and run.git.commit is None and run.round_indices is None


def test_a_file_of_the_base_commit_loads_when_history_is_there(tmp_path):
    """The committed run as the first commit that has it wrote it (a clone without the history,
    a shallow CI checkout, skips)."""
    first = subprocess.run(
        ["git", "log", "--format=%H", "--diff-filter=A", "--", "docs/performance-results.json"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    commits = first.stdout.split()
    if first.returncode != 0 or not commits:
        pytest.skip("no git history of docs/performance-results.json here")
    shown = subprocess.run(
        ["git", "show", f"{commits[-1]}:docs/performance-results.json"], cwd=ROOT, capture_output=True
    )
    if shown.returncode != 0:
        pytest.skip(f"git show failed: {shown.stderr.decode()[:200]}")
    path = tmp_path / "first.json"
    path.write_bytes(shown.stdout)
    run = results.load(path)
    assert run.results and all(r.whole.samples_ms or not r.ok for r in run.results)


def _broken(edit) -> dict:
    data = copy.deepcopy(FIRST_FORMAT)
    edit(data)
    return data


def _set(path: tuple, value):
    def edit(data):
        *parents, last = path
        for key in parents:
            data = data[key]
        data[last] = value

    return edit


def _delete(path: tuple):
    def edit(data):
        *parents, last = path
        for key in parents:
            data = data[key]
        del data[last]

    return edit


# (what is wrong, the edit, what the message must name)
MALFORMED = [
    ("no schema", _delete(("schema",)), "schema: missing"),
    ("a newer schema", _set(("schema",), 2), "schema: this suite reads versions 1 to 1, got 2"),
    ("schema as text", _set(("schema",), "1"), "schema: expected an integer"),
    ("no results", _delete(("results",)), "results: missing"),
    ("results not a list", _set(("results",), {}), "results: expected a list of rows"),
    ("a row not an object", _set(("results", 0), [1]), "results[0]: expected an object"),
    ("a row without its shape", _delete(("results", 0, "shape")), "results[0].shape: missing"),
    ("a row without its provider", _delete(("results", 0, "provider")), "results[0].provider: missing"),
    ("an unknown status", _set(("results", 0, "status"), "maybe"), "results[0].status: expected one of"),
    ("a sample as text", _set(("results", 0, "samples_ms", 1), "0.1"), "results[0].samples_ms[1]: expected a number"),
    ("samples not a list", _set(("results", 0, "samples_ms"), 0.1), "results[0].samples_ms: expected a list"),
    ("m as a float", _set(("results", 0, "m"), 32768.0), "results[0].m: expected an integer"),
    ("a boolean median", _set(("results", 0, "median_ms"), True), "results[0].median_ms: expected a number"),
    ("an error as text", _set(("results", 0, "errors", "y"), "small"), "results[0].errors.y: expected a number"),
    ("residual as text", _set(("results", 0, "residual"), "no"), "results[0].residual: expected true or false"),
    ("device samples as text", _set(("results", 0, "device_samples_ms"), "x"), "results[0].device_samples_ms"),
    ("machine not an object", _set(("machine",), "H200"), "machine: expected an object"),
    ("a commit as a number", _set(("git", "commit"), 7), "git.commit: expected a string"),
    ("copy ceiling as text", _set(("copy", "tbs"), "4.2"), "copy.tbs: expected a number"),
    ("round indices as text", _set(("settings", "round_indices"), "0,1"), "settings.round_indices"),
    ("a copy of x without its bytes", _set(("same_bytes_copy",), {"s": {"m": 1, "n": 1, "dtype": "f",
     "group": "g"}}), "same_bytes_copy['s'].bytes: missing"),
    ("not an object at all", lambda data: data.clear() or data.update(x=1), "schema: missing"),
]  # fmt: skip


@pytest.mark.parametrize("what, edit, message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_file_names_the_field(tmp_path, what, edit, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_broken(edit)))
    with pytest.raises(ValueError) as info:
        results.load(path)
    assert str(info.value).startswith(f"{path}: not a benchmark results file: ")
    assert message in str(info.value)


@pytest.mark.parametrize(
    "text, message",
    [("{not json", "not valid JSON"), ("[1, 2]", "top level: expected an object"), ("null", "top level")],
)
def test_a_file_that_is_not_a_results_object(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        results.load(path)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="no results file .*nothing.json"):
        results.load(tmp_path / "nothing.json")


def test_optional_fields_may_be_null():
    data = _broken(_set(("results", 0, "bytes"), None))
    data.update(git=None, copy=None, machine=None, settings=None, same_bytes_copy=None)
    run = results.from_json(data)
    assert run.results[0].bytes is None and run.git == results.Git() and run.copy == results.CopyCeiling()


def test_unknown_keys_are_ignored():
    data = _broken(_set(("results", 0, "note"), "added by a later harness"))
    data["comment"] = "free text"
    assert results.from_json(data).results[0].shape == "32768x4096-bfloat16"


def test_the_gate_reads_results_without_torch_or_the_op(tmp_path):
    """The results module and the gate import nothing of the op, nor torch."""
    code = (
        "import sys\n"
        "import rmsnorm_suite.gate, rmsnorm_suite.results\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'rmsnorm_kernel')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
