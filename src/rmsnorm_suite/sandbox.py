"""Runs a commit's code in a sandbox that sees nothing of the judge but what it is handed.

Linux namespaces through util-linux (``unshare``, ``setpriv``): new PID, mount and network
namespaces; a new root on a tmpfs holding read-only binds of the system and Python folders, the
folders the caller names (read-only) and one writable state folder; the GPU device nodes; no
network, no inherited environment but a short allow-list. As root the code runs as ``nobody``;
otherwise in a user namespace, as the mapped user with every capability dropped. The sandbox's
first process is its PID 1: when it exits, the kernel kills everything it left behind.
docs/ci.md (threat model) says what this stops and what it cannot.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

NOBODY = 65534  # the user and group a root judge runs commits as
STATE = "/state"  # the writable folder inside: home, temp, Triton and extension caches
# Each tmpfs inside (/tmp, /dev/shm) holds at most this much: they live in the judge's memory.
TMPFS_BYTES = 2 * 2**30
SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt")  # read-only, as they are
DEVICES = ("null", "zero", "full", "random", "urandom")
# Passed through from the judge's environment when set (the GPU and its toolchain); nothing else is.
PASS_ENV = (
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "LD_LIBRARY_PATH",
    "CUDA_HOME", "CUDA_PATH", "TRITON_PTXAS_PATH", "TRITON_LIBCUDA_PATH", "CC", "CXX", "MAX_JOBS",
    "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "LANG", "RMSNORM_KERNEL_HOST",
)  # fmt: skip


class SandboxUnavailable(RuntimeError):
    """This machine cannot make the sandbox (no unshare/setpriv, or namespaces refused)."""


@dataclass(frozen=True)
class Sandbox:
    """One sandbox: ``root`` an empty folder of the judge's (the new root's mount point),
    ``readonly`` inside path -> outside folder, ``state`` an outside folder writable inside at
    /state, ``env`` variables set inside besides the allow-list."""

    root: Path
    readonly: Mapping[str, Path]
    state: Path
    env: Mapping[str, str] = field(default_factory=dict)


def missing_tools() -> list[str]:
    return [t for t in ("unshare", "setpriv", "prlimit", "chroot", "mount", "env") if shutil.which(t) is None]


def python_folders() -> list[Path]:
    """The folders the running Python needs: its prefixes and every existing sys.path folder."""
    found = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), Path(sys.executable).parent]
    found += [Path(sys.executable).resolve().parent]
    found += [Path(p) for p in sys.path if p and Path(p).is_dir()]
    found += [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p and Path(p).is_dir()]
    return found


def _outside_folders(hidden: Sequence[Path]) -> list[Path]:
    """Python's folders, less any inside ``hidden`` (the judge's staging area), less a git
    checkout's root (its .git may hold a token), less those under a system folder already
    bound, each once."""
    keep: list[Path] = []
    for p in python_folders():
        p = p.resolve()
        if any(p.is_relative_to(h.resolve()) for h in hidden) or (p / ".git").exists():
            continue
        if p.parts[1:2] and p.parts[1] in SYSTEM and not Path("/", p.parts[1]).is_symlink():
            continue
        if p not in keep and not any(p.is_relative_to(k) for k in keep):
            keep = [k for k in keep if not k.is_relative_to(p)] + [p]
    return keep


def script(box: Sandbox, hidden: Sequence[Path] = ()) -> str:
    """The shell lines that build the new root inside fresh namespaces, then drop privileges."""
    r = shlex.quote(str(box.root))
    q = shlex.quote
    lines = [
        "set -eu",
        "mount --make-rprivate /",
        f"mount -t tmpfs -o mode=0755 sandbox-root {r}",
    ]

    def bind(outside: Path | str, inside: str, ro: bool = True, folder: bool = True) -> None:
        target = f"{r}{inside}"
        lines.append(f"mkdir -p {q(target)}" if folder else f"touch {q(target)}")
        lines.append(f"mount --rbind {q(str(outside))} {q(target)}")
        if ro:
            lines.append(f"mount -o remount,bind,ro {q(target)}")

    # the private /tmp first: Python folders under the judge's /tmp are bound on top of it
    lines += [f"mkdir -p {r}/tmp", f"mount -t tmpfs -o mode=1777,size={TMPFS_BYTES} tmp {r}/tmp"]
    for name in SYSTEM:
        top = Path("/", name)
        if top.is_symlink():
            lines.append(f"ln -s {q(os.readlink(top))} {r}/{name}")
        elif top.is_dir():
            bind(top, f"/{name}")
    for folder in _outside_folders(hidden):
        bind(folder, str(folder))
    for inside, outside in box.readonly.items():
        bind(outside, inside)
    bind(box.state, STATE, ro=False)
    lines.append(f"mkdir -p {r}/proc {r}/dev/shm")
    lines.append(f"mount -t tmpfs -o mode=1777,size={TMPFS_BYTES} shm {r}/dev/shm")
    for name in DEVICES:
        bind(f"/dev/{name}", f"/dev/{name}", ro=False, folder=False)
    for node in sorted(Path("/dev").glob("nvidia*")):
        bind(node, str(node), ro=False, folder=node.is_dir())
    if Path("/sys").is_dir():  # its submounts (cgroup, ...) stay as they are: root's, not the user's
        bind("/sys", "/sys")
    lines.append(f"mount -t proc proc {r}/proc")
    lines.append(f"mount -o remount,bind,ro {r}")
    return "\n".join(lines)


def search_path(hidden: Sequence[Path] = ()) -> str:
    """PATH inside: the running Python's folder, then the judge's PATH entries that are bound."""
    bound = [Path("/", name) for name in SYSTEM] + _outside_folders(hidden)
    entries = [str(Path(sys.executable).parent)]
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if entry and entry not in entries and any(Path(entry).resolve().is_relative_to(b) for b in bound):
            entries.append(entry)
    return os.pathsep.join(entries + [p for p in ("/usr/bin", "/bin") if p not in entries])


def environment(box: Sandbox, hidden: Sequence[Path] = ()) -> dict[str, str]:
    """The whole environment inside: the allow-list, the state folder's homes, ``box.env``."""
    env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    env.update(
        PATH=search_path(hidden),
        HOME=f"{STATE}/home",
        TMPDIR="/tmp",
        XDG_CACHE_HOME=f"{STATE}/cache",
        TRITON_CACHE_DIR=f"{STATE}/triton",
        TORCH_EXTENSIONS_DIR=f"{STATE}/torch-extensions",
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.update(box.env)
    return env


STATE_FOLDERS = ("home", "cache", "triton", "torch-extensions")


def prepare_state(state: Path, root: bool) -> None:
    """The state folder and its subfolders, each a real folder: anything the commit left in
    their place (a link, a file) is removed, and only folders made here are handed to nobody.
    Nothing inside them is walked or chowned, so no link the commit planted is ever followed."""
    state.mkdir(parents=True, exist_ok=True)
    for folder in (state, *(state / sub for sub in STATE_FOLDERS)):
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            folder.unlink()
        if not folder.exists():
            folder.mkdir()
            if root:
                os.lchown(folder, NOBODY, NOBODY)
        elif folder == state and root:
            os.lchown(folder, NOBODY, NOBODY)


def command(box: Sandbox, argv: Sequence[str], cwd: str = STATE, hidden: Sequence[Path] = ()) -> list[str]:
    """The command that runs ``argv`` in ``box``; ``hidden``: outside folders never bound."""
    missing = missing_tools()
    if missing:
        raise SandboxUnavailable(f"the sandbox needs util-linux's {', '.join(missing)}")
    root = os.geteuid() == 0
    prepare_state(box.state, root)
    drop = ["setpriv", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"]
    if root:
        drop += [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    env = [f"{k}={v}" for k, v in environment(box, hidden).items()]
    inner = ["chroot", str(box.root), *drop, "env", "-i", "-C", cwd, *env, *argv]
    # PID 1 stays this root shell, which never runs the commit's code: a worker that leaves the
    # session cannot outlive it, and when it returns (or is killed) the namespace dies whole.
    # stdin is passed on through fd 3 (an asynchronous list's own stdin is /dev/null).
    run = " ".join(shlex.quote(a) for a in inner)
    body = script(box, hidden) + f"\nexec 3<&0\n{run} <&3 3<&- &\nwait $!"
    user = [] if root else ["--user", "--map-root-user"]
    return ["unshare", *user, "--mount", "--pid", "--fork", "--net", "--kill-child", "sh", "-c", body]


def check() -> str | None:
    """None when a sandbox can be made here, else why not (one line)."""
    missing = missing_tools()
    if missing:
        return f"the sandbox needs util-linux's {', '.join(missing)}"
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rmsnorm-sandbox-check-") as tmp:
        box = Sandbox(Path(tmp, "root"), {}, Path(tmp, "state"))
        box.root.mkdir()
        done = subprocess.run(
            command(box, [sys.executable, "-I", "-c", "print('ok')"]), capture_output=True, text=True
        )
        if done.returncode != 0 or done.stdout.strip() != "ok":
            return f"namespaces refused here: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    return None
