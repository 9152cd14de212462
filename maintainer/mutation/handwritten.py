"""Hand-written mutants (handwritten.toml beside this module): one per class of bug a review
found the suite blind to, each run with the CPU kill command it names (or, for code outside
the config's targets such as the compiled host path's C++, the pytest arguments it gives) in a
copy of the tree. Apart from the sessions' samples; the outcomes go to a record the report shows."""

from __future__ import annotations

import dataclasses
import json
import tempfile
import threading
import time
from pathlib import Path

from maintainer.mutation.catalogue import apply_patch
from maintainer.mutation.config import ROOT, Config, MutationError, read_toml
from maintainer.mutation.session import file_hashes

HANDWRITTEN = Path("maintainer/mutation/handwritten.toml")
RECORD = Path("docs/data/handwritten.json")


@dataclasses.dataclass(frozen=True)
class Handwritten:
    id: str
    cls: str  # the class of bug
    file: str
    old: str
    new: str
    kill: str  # a kill command of config.toml [kill.cpu], or a label for ``args``
    args: tuple[str, ...] = ()  # pytest arguments of its own kill command (code no target covers)

    def steps(self, config: Config) -> list[dict]:
        return [{"args": list(self.args)}] if self.args else config.kill["cpu"][self.kill]

    def kill_text(self) -> str:
        return f"{self.kill}: `pytest {' '.join(self.args)}`" if self.args else self.kill


def load_handwritten(root: Path = ROOT) -> list[Handwritten]:
    entries = read_toml(root / HANDWRITTEN).get("mutant", [])
    out = [
        Handwritten(e["id"], e["class"], e["file"], e["old"], e["new"], e["kill"], tuple(e.get("args", ())))
        for e in entries
    ]
    if len({h.id for h in out}) != len(out):
        raise MutationError(f"{HANDWRITTEN}: an id appears twice")
    return out


def mutated(h: Handwritten, root: Path = ROOT) -> str:
    """The file's text with the mutant applied; MutationError unless its old text occurs once."""
    return apply_patch((root / h.file).read_text(encoding="utf-8"), h)


def run_all(config: Config, root: Path = ROOT, log=print) -> dict[str, dict]:
    """Each mutant's outcome ("killed" | "survived") under its kill command, with the seconds it
    took and the hash of the file it mutated."""
    from maintainer.mutation.runner import make_tree, run_kill

    results = {}
    with tempfile.TemporaryDirectory(prefix="rmsnorm-handwritten-") as tmp:
        for h in load_handwritten(root):
            tree = make_tree(root, Path(tmp) / h.id, config.tree)
            (tree / h.file).write_text(mutated(h, root), encoding="utf-8")
            t0 = time.monotonic()
            outcome, _tail = run_kill(tree, h.steps(config), 3600, threading.Event())
            seconds = time.monotonic() - t0
            results[h.id] = {"outcome": outcome, "seconds": round(seconds, 1), "kill": h.kill,
                             "hash": file_hashes(root, {h.file})[h.file], "date": time.strftime("%Y-%m-%d")}  # fmt: skip
            log(f"{h.id}: {outcome} by kill command {h.kill} in {seconds:.0f} s")
    return results


def render(root: Path = ROOT) -> list[str]:
    """The report's section: each mutant, its class and the recorded outcome (stale where its
    file changed since the record)."""
    if not (root / HANDWRITTEN).is_file():
        return []
    record = json.loads((root / RECORD).read_text()) if (root / RECORD).is_file() else {}
    out = ["## Hand-written mutants", "",
           f"Outside the samples (`{HANDWRITTEN}`), one per class of bug a review found the suite blind to;",
           "`python -m maintainer.mutation handwritten --record` runs each under its CPU kill command.",
           "The compiled host path's C++ (`src/rmsnorm_kernel/host/csrc/host.cpp`) has no sampled session:",
           "cosmic-ray mutates Python only, so its route checks get hand-written mutants here, each with",
           "the tests that build the mutated source as its kill command.", "",
           "| mutant | class | file | kill command | outcome |", "|---|---|---|---|---|"]  # fmt: skip
    for h in load_handwritten(root):
        r = record.get(h.id)
        if r is None:
            outcome = "**not run**"
        else:
            stale = "" if r["hash"] == file_hashes(root, {h.file})[h.file] else " (**file changed since**)"
            outcome = f"{r['outcome']} ({r['date']}, {r['seconds']:.0f} s){stale}"
        out.append(f"| `{h.id}` | {h.cls} | `{h.file}` | {h.kill_text()} | {outcome} |")
    return [*out, ""]
