"""The hostile-head catalogue on CPU: each attack is a fixture commit whose op is slow (each call
sleeps, as a head that runs the op twice is slow) and which tries to hide that from the judge.
pr-verdict runs it end to end (sandboxed workers, the host-clock stand-in) and every head must
end REGRESSION or error, never pass. The GPU run of the same catalogue: tools/hostile_heads.py,
its figures in docs/gate.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from rmsnorm_suite import cli, exchange, pullrequest, sandbox, staging
from tests.suite import hostile_catalogue as catalogue
from tests.suite._fixtures import INIT, OPS, SLOW_S, BaseRounds, git
from tests.suite._fixtures import commit as plain_commit

TRUSTED_CONFTEST = "import pytest\n"
TRUSTED_PYPROJECT = '[tool.pytest.ini_options]\nmarkers = ["gpu: needs CUDA"]\n'
# factor 2: on a loaded 2-core machine an A/A's host-clock rounds move by tens of percent; the
# slow heads are hundreds of times slower
LOOSE = (
    "[gate]\nmin_samples = 2\n[clock]\ntolerance = 0.5\ncheckpoint = 50.0\n[stopwatch]\ntolerance = 3.0\nconsistency = 0.95\nshare = 0.0\nsingle = 0.95\nany_round = 3.0\n"
    "[latency.large.forward]\nfactor = 2.0\nalpha = 0.01\n"
    "[numerics.bfloat16]\ngrowth = 1.05\nceiling = {{y = 0.01}}\n[features]\nbatch_invariance = 0\n"
)
ARGS = ["--shapes", "32768x4096-bfloat16", "--modes", "forward", "--rounds", "3", "--samples", "8"]

pytestmark = pytest.mark.skipif(bool(sandbox.check()), reason=f"no sandbox here: {sandbox.check()}")


def commit(repo: Path, files: dict[str, str], message: str, links: dict[str, str] | None = None) -> str:
    """The shared commit helper (tests/suite/_fixtures.py), with ``links``: paths committed as symbolic links to a target."""
    for name, target in (links or {}).items():
        path = repo / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)
    return plain_commit(repo, files, message)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A repository with a fast base and one slow, hostile head per attack; the paths the
    attacks aim at (markers a surviving process would write, the verdict folder)."""
    root = tmp_path_factory.mktemp("hostile")
    repo, out, markers = root / "repo", root / "out", root / "markers"
    repo.mkdir()
    markers.mkdir()
    git(repo, "init", "-q", "-b", "main")
    op = "src/rmsnorm_kernel/"
    base_files = {op + "__init__.py": INIT,
                  op + "ops.py": OPS.format(cost=0.0), "src/rmsnorm_suite/__init__.py": ""}  # fmt: skip
    base = commit(repo, base_files, "fast op")
    heads: dict[str, str] = {}
    for name in catalogue.ATTACKS:
        git(repo, "checkout", "-q", "-B", name, base)
        code = catalogue.attack(
            name,
            str(out / name / "verdict.json"),
            str(markers / name),
            f"rmsnorm-hostile-{root.name}-{os.getpid()}",
        )
        heads[name] = commit(repo, {op + "ops.py": OPS.format(cost=SLOW_S) + code}, name)
    git(repo, "checkout", "-q", "-B", "symlinked-package", base)
    (repo / "elsewhere").mkdir()
    heads["symlinked-package"] = commit(
        repo, {"elsewhere/__init__.py": "", "elsewhere/ops.py": OPS.format(cost=SLOW_S)}, "link",
        links={"src/rmsnorm_kernel": "../elsewhere"},
    )  # fmt: skip
    git(repo, "checkout", "-q", "-B", "symlinked-module", base)
    heads["symlinked-module"] = commit(repo, {}, "link", links={op + "ops.py": "/etc/hostname"})
    git(repo, "checkout", "-q", "-B", "head-conftest", base)
    heads["head-conftest"] = commit(
        repo,
        {op + "ops.py": OPS.format(cost=SLOW_S), "tests/__init__.py": "", "tests/test_gpu.py": catalogue.FAILING_GPU_TEST,
         "tests/conftest.py": catalogue.CONFTEST.format(marker=markers / "head-conftest")},
        "a conftest that reports success",
    )  # fmt: skip
    git(repo, "checkout", "-q", "main")
    trusted = root / "trusted"
    (trusted / "tests").mkdir(parents=True)
    (trusted / "tests" / "conftest.py").write_text(TRUSTED_CONFTEST)
    (trusted / "pyproject.toml").write_text(TRUSTED_PYPROJECT)
    (root / "loose.toml").write_text(LOOSE.format())
    return {"repo": repo, "base": base, "heads": heads, "out": out, "markers": markers, "root": root,
            "trusted": trusted, "token": f"rmsnorm-hostile-{root.name}-{os.getpid()}"}  # fmt: skip


# Heads whose attack aims at the base's rounds of their own verdict (a writer to the base's staged
# op, spinners that load the base's rounds): their base runs beside them, never from the store.
AIMED_AT_THE_BASE = ("left-behind-writer", "spins-during-the-base")


def run_verdict(world, name: str, monkeypatch, shared: BaseRounds, gpu_tests: bool = False) -> dict:
    """One head's verdict; the base's rounds from ``shared`` (BaseRounds), unless the head aims
    at them."""
    monkeypatch.setattr(pullrequest, "WORKER_TIMING", "host")
    if name not in AIMED_AT_THE_BASE:
        shared.install(monkeypatch)
    monkeypatch.setattr(staging, "trusted_root", lambda: world["trusted"])
    out = world["out"] / name
    argv = ["pr-verdict", "--repo", str(world["repo"]), "--base", world["base"], "--head", world["heads"][name],
            "--out", str(out), "--thresholds", str(world["root"] / "loose.toml"), *ARGS]  # fmt: skip
    code = cli.main(argv + ([] if gpu_tests else ["--skip-gpu-tests"]))
    data = json.loads((out / "verdict.json").read_text())
    assert code == {"regression": 1, "error": 2}.get(data["status"], 0)
    return data


def survivors(token: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and token.encode() in (proc / "cmdline").read_bytes():
                found.append(proc.name)
        except OSError:
            continue
    return found


@pytest.mark.parametrize(
    "name, status, why",
    [
        ("clock-at-import", "error", "the clock was replaced when the op was imported: time.perf_counter"),
        ("clock-from-a-thread", "error", "the clock was replaced during the round: time.perf_counter"),
        ("harness-code-swapped", "error", "rmsnorm_suite.timing.median"),
        ("left-behind-writer", "regression", ""),
        # its spinners load its own rounds until each ends: its own calibration may disagree
        ("spins-during-the-base", "regression error", ""),
        ("frames-rewrite", "error", "disagrees with head's own times"),
        ("cached-outputs", "error", "disagrees with head's own times"),
        ("stopwatch-swapped", "error", "rmsnorm_suite.worker.stopwatch"),
        ("wrong-op-in-stopwatch", "error", "stopwatch outputs differ from base's"),
        ("stopwatch-served", "error", "its instance or class"),
        ("answer-before-go", "error", "each after the judge's line"),
        ("symlinked-package", "error", "src/rmsnorm_kernel (a link)"),
        ("symlinked-module", "error", "src/rmsnorm_kernel/ops.py (a link)"),
    ],
)
def test_hostile_head_never_passes(world, monkeypatch, base_rounds, name, status, why):
    data = run_verdict(world, name, monkeypatch, base_rounds)
    assert data["status"] in status.split(), data["summary"]
    assert why in json.dumps(data), data["summary"]
    time.sleep(0.5)  # a surviving writer would have written by now
    assert not (world["markers"] / name).exists(), "a process of the head outlived its sandbox"
    assert survivors(world["token"]) == []
    assert "forged" not in (world["out"] / name / "verdict.json").read_text()


@pytest.mark.parametrize("name", catalogue.STOPWATCH_ONLY)
def test_only_the_stopwatch_sees_a_head_that_fools_its_process(world, monkeypatch, base_rounds, name):
    """These heads make the harness inside their process report them fast (the latency rows
    pass); the judge's own clock, outside the sandbox, sees them slow, and slower than their own
    rows say: the verdict is `error` (the judge's clock disagrees), not a pass."""
    data = run_verdict(world, name, monkeypatch, base_rounds)
    rows = {r["check"]: r for r in data["rows"]}
    latency = [r for r in data["rows"] if r["kind"] == "latency"]
    assert latency and all(r["verdict"] == "pass" for r in latency), latency
    watch = rows["stopwatch"]
    assert watch["verdict"] == "error" and "disagrees with head's own times" in watch["note"], watch
    assert watch["ratio"] > 4, watch


def test_head_conftest_never_runs(world, monkeypatch, base_rounds):
    """Head's GPU tests run with the trusted conftest: head's own, which would turn a failure
    into success and leave a marker, is left out, and the verdict says so."""
    data = run_verdict(world, "head-conftest", monkeypatch, base_rounds, gpu_tests=True)
    assert data["status"] == "regression", data["summary"]
    row = next(r for r in data["rows"] if r["check"] == "gpu tests (head)")
    assert row["verdict"] == "regression" and "exit 1" in row["note"], row
    assert "head's tests/conftest.py not used" in row["note"] and "2 test files of head" in row["note"]
    assert not (world["markers"] / "head-conftest").exists()


def test_an_honest_head_passes_with_its_clock_checked(world, monkeypatch, base_rounds):
    """The same commit on both sides: PASS, with a clock row that held head's calibration to base's."""
    world["heads"]["same"] = world["base"]
    data = run_verdict(world, "same", monkeypatch, base_rounds)
    assert data["status"] == "pass", data["summary"]
    clock = next(r for r in data["rows"] if r["check"] == "clock")
    assert clock["verdict"] == "pass" and "over 3 rounds" in clock["note"]


def test_sandbox_hides_the_judge(tmp_path):
    """Inside: no network, nothing of the judge's files but what is handed read-only, a user that
    cannot write them, no inherited secrets; outside: nothing it started survives."""
    handed = tmp_path / "handed"
    handed.mkdir()
    (handed / "f.txt").write_text("handed")
    secret = tmp_path / "secret.txt"
    secret.write_text("the judge's")
    box = sandbox.Sandbox(tmp_path / "root", {"/judge/h": handed}, tmp_path / "state")
    box.root.mkdir()
    code = (
        "import os, socket, subprocess, sys, json\n"
        "seen = {'uid': os.getuid(), 'pid': os.getpid(), 'env': sorted(os.environ)}\n"
        f"seen['secret'] = os.path.exists({str(secret)!r})\n"
        "seen['handed'] = open('/judge/h/f.txt').read()\n"
        "def writes(p):\n    try:\n        open(p, 'w').write('x'); return True\n    except OSError:\n        return False\n"
        "seen['writes'] = {p: writes(p) for p in ['/judge/h/f.txt', '/usr/x', '/state/x', '/tmp/rmsnorm-write-probe']}\n"
        "try:\n    socket.create_connection(('127.0.0.1', 22), timeout=1); seen['net'] = True\n"
        "except OSError:\n    seen['net'] = False\n"
        "subprocess.Popen(['sleep', '300', 'rmsnorm-sandbox-survivor'], start_new_session=True)\n"
        "print(json.dumps(seen))\n"
    )
    env = {**os.environ, "RMSNORM_SECRET_TOKEN": "x"}
    done = subprocess.run(
        sandbox.command(box, [os.sys.executable, "-I", "-c", code]), capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["pid"] != 1 and seen["handed"] == "handed" and not seen["secret"] and not seen["net"]
    assert seen["writes"] == {
        "/judge/h/f.txt": False,
        "/usr/x": False,
        "/state/x": True,
        "/tmp/rmsnorm-write-probe": True,
    }
    assert "RMSNORM_SECRET_TOKEN" not in seen["env"] and "GITHUB_TOKEN" not in seen["env"]
    if os.geteuid() == 0:
        assert seen["uid"] == sandbox.NOBODY
    assert survivors("rmsnorm-sandbox-survivor") == []


def test_the_writer_attack_works_outside_a_sandbox(tmp_path):
    """The catalogue's left-behind writer, run as plain code: it does outlive its process and
    write, so the sandboxed runs above show the sandbox stopping it, not a dud attack."""
    token = f"rmsnorm-unsandboxed-{tmp_path.name}"
    marker = tmp_path / "marker"
    staging = str(tmp_path / "rmsnorm-pr-verdict-*")  # not the judges other tests are running
    code = "def rms_norm(x):\n    return x\n" + catalogue.attack(
        "left-behind-writer", "", str(marker), token, staging
    )
    env = {k: v for k, v in os.environ.items() if k != "RMSNORM_WRITER"}
    subprocess.run([os.sys.executable, "-c", code], check=True, env=env, timeout=60)
    try:
        for _ in range(100):
            if marker.exists():
                break
            time.sleep(0.1)
        assert marker.read_text() == "alive" and survivors(token)
    finally:
        for pid in survivors(token):
            os.kill(int(pid), 9)


USERNS_PROBE = """import json, os, subprocess, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import sandbox
base = Path(sys.argv[2])
box = sandbox.Sandbox(base / "root", {}, base / "state")
box.root.mkdir()
code = (
    "import json, os, subprocess\\n"
    "def writes(p):\\n    try:\\n        open(p, 'w').write('x'); return True\\n    except OSError:\\n        return False\\n"
    "remount = subprocess.run(['mount', '-o', 'remount,bind,rw', '/usr'], capture_output=True).returncode\\n"
    "print(json.dumps({'uid': os.getuid(), 'pid': os.getpid(), 'usr': writes('/usr/x'),"
    " 'state': writes('/state/x'), 'remount': remount}))\\n"
)
done = subprocess.run(sandbox.command(box, [sys.executable, "-I", "-c", code]), capture_output=True, text=True)
print(done.stdout if done.returncode == 0 else "FAILED " + done.stderr)
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").is_file(), reason="needs root to become nobody"
)
def test_sandbox_for_a_judge_that_is_not_root(tmp_path):
    """A judge that is not root gets a user namespace: the caller mapped to root inside, every
    capability dropped, so the read-only binds stay read-only (remounting them fails)."""
    import shutil
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="rmsnorm-userns-"))
    try:
        shared.chmod(0o777)
        shutil.copy(Path(sandbox.__file__), shared / "sandbox.py")
        (shared / "work").mkdir(mode=0o777)
        (shared / "work").chmod(0o777)
        as_nobody = ["setpriv", f"--reuid={sandbox.NOBODY}", f"--regid={sandbox.NOBODY}", "--clear-groups"]
        done = subprocess.run(
            [*as_nobody, "/usr/bin/python3", "-I", "-c", USERNS_PROBE, str(shared), str(shared / "work")],
            capture_output=True, text=True, cwd=shared, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )  # fmt: skip
        if "FAILED" in done.stdout and "unshare" in done.stdout:
            pytest.skip(f"unprivileged user namespaces refused here: {done.stdout[-200:]}")
        seen = json.loads(done.stdout)
        assert (seen["uid"], seen["usr"], seen["state"]) == (0, False, True) and seen["pid"] != 1, seen
        assert seen["remount"] != 0
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_flood_on_the_pipe_or_stdout_is_cut(tmp_path, monkeypatch):
    """The judge keeps at most OUTPUT_CAP of what a sandbox hands back: results past it are
    dropped whole (the round fails), stdout keeps its tail."""
    monkeypatch.setattr(exchange, "OUTPUT_CAP", 2**20)
    box = sandbox.Sandbox(tmp_path / "root", {}, tmp_path / "state")
    box.root.mkdir()
    code = (
        "import os, sys\nfd = int(sys.stdin.read())\n"
        "os.write(1, b'x' * 3 * 2**20 + b'END')\n"
        "for _ in range(3):\n    os.write(fd, b'y' * 2**20)\n"
    )
    done = exchange.sandboxed(box, [os.sys.executable, "-I", "-c", code], str, 60)
    assert done.code == 0 and done.lines == [] and "more than 1048576 bytes, cut" in done.err
    assert len(done.out) == 2**20 and done.out.endswith("END")


def test_a_tree_entry_named_dotdot_is_refused(tmp_path):
    """A commit can hold a tree entry named `..` (git writes one with --literally): staged as a
    path it would land outside the staging folder, on the trusted suite. It is refused."""
    repo = tmp_path / "repo"
    git(tmp_path, "init", "-q", str(repo))
    blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=repo, input=b"forged", capture_output=True,
                          check=True).stdout.decode().strip()  # fmt: skip
    raw = b"100644 worker.py\0" + bytes.fromhex(blob)
    inner = subprocess.run(["git", "hash-object", "-w", "-t", "tree", "--literally", "--stdin"], cwd=repo,
                           input=raw, capture_output=True, check=True).stdout.decode().strip()  # fmt: skip
    init = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=repo, input=b"", capture_output=True,
                          check=True).stdout.decode().strip()  # fmt: skip
    raw = b"40000 ..\0" + bytes.fromhex(inner) + b"100644 __init__.py\0" + bytes.fromhex(init)
    package = subprocess.run(["git", "hash-object", "-w", "-t", "tree", "--literally", "--stdin"], cwd=repo,
                             input=raw, capture_output=True, check=True).stdout.decode().strip()  # fmt: skip
    raw = b"40000 rmsnorm_kernel\0" + bytes.fromhex(package)
    src = subprocess.run(["git", "hash-object", "-w", "-t", "tree", "--literally", "--stdin"], cwd=repo,
                         input=raw, capture_output=True, check=True).stdout.decode().strip()  # fmt: skip
    raw = b"40000 src\0" + bytes.fromhex(src)
    top = subprocess.run(["git", "hash-object", "-w", "-t", "tree", "--literally", "--stdin"], cwd=repo,
                         input=raw, capture_output=True, check=True).stdout.decode().strip()  # fmt: skip
    sha = git(repo, "commit-tree", top, "-m", "dotdot")
    with pytest.raises(ValueError, match=r"refused: 'src/rmsnorm_kernel/\.\./worker\.py'"):
        staging.stage_op(repo, sha, tmp_path / "staged")
    assert not (tmp_path / "staged").exists() or not list((tmp_path / "staged").rglob("worker.py"))


def test_a_worker_that_leaves_the_session_dies_with_its_round(tmp_path):
    """The worker calls setsid and hangs; at the round's timeout the whole namespace dies (its
    PID 1 is the judge's root shell, not the worker), so nothing of it survives as any user."""
    token = f"rmsnorm-setsid-{os.getpid()}"
    box = sandbox.Sandbox(tmp_path / "root", {}, tmp_path / "state")
    box.root.mkdir()
    code = "import os, subprocess, sys, time\nos.setsid()\nsubprocess.Popen(['sleep', '300', sys.argv[1]])\ntime.sleep(300)\n"
    exit_code = exchange.sandboxed(box, [os.sys.executable, "-I", "-c", code, token], str, 3).code
    assert exit_code is None  # timed out
    time.sleep(1)
    assert survivors(token) == []


def test_the_sandbox_bounds_its_memory_files_and_processes(tmp_path, monkeypatch):
    """/tmp inside is a tmpfs of at most TMPFS_BYTES (it lives in the judge's memory), and its
    user's processes stop at PROC_CAP: a head cannot fill the judge's memory or fork without end."""
    monkeypatch.setattr(sandbox, "TMPFS_BYTES", 4 * 2**20)
    monkeypatch.setattr(exchange, "PROC_CAP", 64)
    box = sandbox.Sandbox(tmp_path / "root", {}, tmp_path / "state")
    box.root.mkdir()
    code = (
        "import os, subprocess, sys\n"
        "try:\n    open('/tmp/big', 'wb').write(b'x' * 16 * 2**20)\n    print('tmp: wrote 16 MiB')\n"
        "except OSError as exc:\n    print('tmp:', exc.strerror)\n"
        "kids = []\n"
        "try:\n    for _ in range(200):\n        kids.append(subprocess.Popen(['sleep', '30']))\n"
        "except OSError as exc:\n    print('processes:', len(kids), exc.strerror)\n"
        "for k in kids:\n    k.kill()\n"
    )
    done = exchange.sandboxed(box, [os.sys.executable, "-I", "-c", code], str, 60)
    assert "tmp: No space left on device" in done.out, done.out + done.err
    assert "processes:" in done.out and "Resource temporarily unavailable" in done.out, done.out + done.err
    assert int(done.out.split("processes:")[1].split()[0]) < 64
