"""Installing the op as the README's install section says: a wheel into a fresh virtualenv.

The wheel is built from a copy of the project (the working tree gets no ``build/`` or
``*.egg-info``), installed with ``--no-deps`` into a virtualenv made with
``--system-site-packages`` (torch and triton come from the running environment: nothing is
downloaded), then imported and called under ``TRITON_INTERPRET=1`` from an empty folder with a
clean ``PYTHONPATH``, so the module that runs is the installed one, not this tree's ``src``.
"""

from __future__ import annotations

import email
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# what a wheel build reads (pyproject's readme and package discovery)
PROJECT_FILES = ("pyproject.toml", "README.md")
# Python 3.12+ virtualenvs come without setuptools: pip then fetches it for an isolated build
ISOLATION = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []

# run by the installed interpreter: the op against torch's own rms_norm, on the interpreter
PROBE = """
import sys
import torch
import torch.nn.functional as F
import rmsnorm_kernel
from rmsnorm_kernel import rms_norm

print(rmsnorm_kernel.__file__)
x = torch.randn(4, 96, dtype=torch.float32)
w = torch.randn(96, dtype=torch.float32)
torch.testing.assert_close(rms_norm(x, weight=w, eps=1e-6), F.rms_norm(x, (96,), w, eps=1e-6))
print("match")
"""


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONNOUSERSITE"] = "1"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of the project, built from a copy of the tree: with the environment's setuptools
    where it has one (no download), else in pip's isolated build environment."""
    src = tmp_path_factory.mktemp("project")
    for name in PROJECT_FILES:
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *ISOLATION, "-w", str(dist), str(src)],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    wheels = sorted(dist.glob("rmsnorm_kernel-*.whl"))
    assert len(wheels) == 1, [p.name for p in dist.iterdir()]
    return wheels[0]


def test_wheel_requires_only_torch_and_triton(wheel):
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(zf.read(name))
    requires = metadata.get_all("Requires-Dist") or []
    unconditional = sorted(r.split(";")[0].strip() for r in requires if "extra ==" not in r)
    names = {r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in unconditional}
    assert names == {"torch", "triton"}, unconditional
    extras = set(metadata.get_all("Provides-Extra") or [])
    assert {"interpret", "suite"} <= extras, extras  # the README's install section names both


def test_wheel_installs_and_runs_in_a_fresh_virtualenv(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # --system-site-packages reaches the base interpreter's packages only; where this runs in a
    # virtualenv itself (nox), its site-packages (torch, triton, numpy) are added after the new
    # environment's own, so the installed wheel comes first
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True, env=_clean_env(),
    ).stdout.strip()  # fmt: skip
    outer = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    Path(site, "outer-environment.pth").write_text("".join(f"{p}\n" for p in sorted(outer)), encoding="utf-8")
    install = subprocess.run(
        # pip of the running environment, told which interpreter to install for
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--ignore-installed",  # the outer environment may hold this version already (nox's does)
            str(wheel),
        ],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    cwd = tmp_path / "elsewhere"  # not the tree: `import rmsnorm_kernel` must find the installed copy
    cwd.mkdir()
    done = subprocess.run(
        [str(python), "-c", PROBE], cwd=cwd, capture_output=True, text=True, env=_clean_env(), timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    location, verdict = done.stdout.strip().splitlines()[-2:]
    assert Path(location).resolve().is_relative_to(env_dir.resolve()), location
    assert verdict == "match"
