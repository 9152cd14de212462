"""The failure catalogue (catalogue.toml beside this module): hand-written patches of
the kernels, one per failure mode and kernel path, run like any cosmic-ray mutant. A patch whose
old text does not occur exactly once is an error, never a skip.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from maintainer.mutation.config import ROOT, MutationError, read_toml

CATALOGUE = Path("maintainer/mutation/catalogue.toml")
CATALOGUE_OPERATOR = "catalogue"  # operator name of catalogue patches in the session database


@dataclasses.dataclass(frozen=True)
class Patch:
    """One known failure mode written as a patch of a production file on one kernel path."""

    id: str
    failure: str
    path: str  # kernel path: tile, two-walk, wide, cooperative, EVEN, ...
    file: str
    old: str
    new: str
    gpu_only: bool = False


def load_catalogue(root: Path = ROOT, path: Path = CATALOGUE) -> list[Patch]:
    data = read_toml(root / path)
    patches, seen = [], set()
    for i, entry in enumerate(data.get("patch", [])):
        missing = [k for k in ("id", "failure", "path", "file", "old", "new") if k not in entry]
        if missing:
            raise MutationError(f"{path}: patch #{i + 1} lacks {', '.join(missing)}")
        if entry["id"] in seen:
            raise MutationError(f"{path}: patch id {entry['id']!r} appears twice")
        if entry["old"] == entry["new"]:
            raise MutationError(f"{path}: patch {entry['id']!r} changes nothing")
        seen.add(entry["id"])
        patches.append(Patch(**{k: entry[k] for k in Patch.__dataclass_fields__ if k in entry}))
    return patches


def apply_patch(text: str, patch: Patch) -> str:
    """``text`` with the patch applied (a catalogue Patch, or anything with its id, file, old and
    new: a hand-written mutant); MutationError unless its old text occurs exactly once."""
    count = text.count(patch.old)
    if count != 1:
        raise MutationError(
            f"patch {patch.id!r} ({patch.file}): its old text occurs {count} times, "
            "not once; the production code changed, so the patch must be rewritten"
        )
    return text.replace(patch.old, patch.new, 1)


def check_catalogue(patches: list[Patch], root: Path = ROOT) -> None:
    """Every patch applies exactly once to the current files (MutationError naming the first that
    does not) and leaves valid Python."""
    for patch in patches:
        patched = apply_patch((root / patch.file).read_text(encoding="utf-8"), patch)
        try:
            compile(patched, patch.file, "exec")
        except SyntaxError as exc:
            raise MutationError(f"catalogue patch {patch.id!r} leaves invalid Python: {exc}") from exc
