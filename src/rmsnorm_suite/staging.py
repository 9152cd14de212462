"""What of a commit the judge runs, read from git's objects, never from a worktree.

pr-verdict stages each side's op alone (plain files only: a link, a submodule or any other
non-file entry in the op's package is refused), head's ``src/`` and ``tests/`` for its GPU tests
with the trusted checkout's conftest.py and pytest configuration, and a copy of the trusted suite.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import rmsnorm_suite

OP_PACKAGE = "src/rmsnorm_kernel"
OP_MODULES = ("__init__", "kernels", "launch", "ops", "module", "reference")  # the op, in both layouts


def git_text(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"git {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


def resolve(repo: Path, rev: str, flag: str) -> str:
    try:
        return git_text(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except ValueError:
        raise ValueError(f"{flag}: {rev!r} is not a commit of {repo}") from None


def merge_base(repo: Path, base: str, head: str) -> str:
    try:
        return git_text(repo, "merge-base", base, head)
    except ValueError:
        raise ValueError(f"--base: {base[:12]} and --head {head[:12]} have no merge-base in {repo}") from None


def trusted_commit() -> str | None:
    """The commit of the trusted checkout this suite runs from, when it is a git checkout."""
    try:
        return git_text(Path(rmsnorm_suite.__file__).resolve().parent, "rev-parse", "HEAD")
    except (ValueError, OSError):
        return None


def stage_trusted_suite(dest: Path) -> Path:
    """A copy of the running (trusted) suite package under ``dest``; returns ``dest``."""
    source = Path(rmsnorm_suite.__file__).resolve().parent
    shutil.copytree(source, dest / "rmsnorm_suite", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


PLAIN = ("100644", "100755")  # git's modes of a regular file


def _git_bytes(repo: Path, *args: str) -> bytes:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True)
    if done.returncode != 0:
        raise ValueError(f"git {' '.join(args)} failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def tree_entries(repo: Path, sha: str, path: str) -> list[tuple[str, str, str, str]]:
    """(mode, type, object, path) of every entry under ``path`` in commit ``sha``, from git's
    objects (never the file system: a worktree can hold links the tree shows as what they are)."""
    raw = _git_bytes(repo, "ls-tree", "-r", "-z", "--full-tree", sha, "--", path).decode()
    entries = []
    for item in filter(None, raw.split("\0")):
        meta, name = item.split("\t", 1)
        if "\\" in name or any(part in ("", ".", "..", ".git") for part in name.split("/")):
            raise ValueError(f"{sha[:12]}: the tree holds a path that is refused: {name!r}")
        mode, kind, obj = meta.split()
        entries.append((mode, kind, obj, name))
    return entries


def _write_blobs(repo: Path, entries, strip: str, dest: Path) -> None:
    for _mode, _kind, obj, name in entries:
        target = dest / name[len(strip) :].lstrip("/")
        if not target.resolve().is_relative_to(dest.resolve()):
            raise ValueError(f"{name!r} would be staged outside its folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_git_bytes(repo, "cat-file", "blob", obj))


def stage_op(repo: Path, sha: str, dest: Path) -> Path:
    """Commit ``sha``'s op, read from git's objects, under ``dest/rmsnorm_kernel``; returns
    ``dest``. A link, a submodule or any other non-file entry under the op's package is refused
    (ValueError). Where the suite has its own package (``src/rmsnorm_suite``) the whole op
    package is staged (with ``csrc/``: without it the op would fall back to the Python host
    path); in older commits, where the suite lived in the op's package, only OP_MODULES are."""
    entries = tree_entries(repo, sha, OP_PACKAGE)
    bad = [f"{name} ({'a link' if mode == '120000' else 'a submodule' if mode == '160000' else mode})"
           for mode, _kind, _obj, name in entries if mode not in PLAIN]  # fmt: skip
    if bad:
        raise ValueError(
            f"{sha[:12]}: only plain files are staged, and the op's package holds {', '.join(bad)}"
        )
    names = {name: e for e in entries for name in [e[3]]}
    if f"{OP_PACKAGE}/__init__.py" not in names:
        raise ValueError(f"{sha[:12]}: no {OP_PACKAGE}/__init__.py in this commit")
    if not tree_entries(repo, sha, "src/rmsnorm_suite"):
        entries = [names[f"{OP_PACKAGE}/{m}.py"] for m in OP_MODULES if f"{OP_PACKAGE}/{m}.py" in names]
    _write_blobs(repo, entries, "src", dest)
    return dest


def stage_head_tests(repo: Path, sha: str, trusted_root: Path, dest: Path) -> tuple[Path, str]:
    """Head's whole tree from git's objects under ``dest`` (its tests read docs, workflows and
    configs too), plain files only, every conftest.py of head's left out and the trusted
    checkout's ``tests/conftest.py`` and ``pyproject.toml`` (pytest's configuration) in their
    place. Returns (dest, a note naming what was head's and what was left out)."""
    entries = tree_entries(repo, sha, ".")
    plain = [e for e in entries if e[0] in PLAIN and Path(e[3]).name != "conftest.py"]
    conftests = [e[3] for e in entries if Path(e[3]).name == "conftest.py"]
    others = [e[3] for e in entries if e[0] not in PLAIN]
    _write_blobs(repo, plain, "", dest)
    for name in ("tests/conftest.py", "pyproject.toml"):
        source = trusted_root / name
        if not source.is_file():
            raise ValueError(f"the trusted checkout has no {name} (pytest's configuration for head's tests)")
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest / name)
    tests = sum(1 for e in plain if e[3].startswith("tests/"))
    note = (
        f"{tests} test files of head {sha[:12]}; conftest.py and pytest configuration the trusted checkout's"
    )
    if conftests:
        note += f"; head's {', '.join(conftests)} not used"
    if others:
        note += f"; {len(others)} links or submodules left out"
    return dest, note


def trusted_root() -> Path:
    """The checkout the running suite comes from (src/rmsnorm_suite's grandparent)."""
    return Path(rmsnorm_suite.__file__).resolve().parents[2]
