"""`clean`: delete the generated output and artifact folders of a config (preview with --dry-run)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from rmsnorm_suite.config import Config
from rmsnorm_suite.console import (
    add_common_arguments,
    print_json,
    run_command,
)


def generated_paths(cfg: Config) -> list[Path]:
    """What `clean --scope generated` removes: the config's output and artifact folders, and only
    those (config.py already refuses absolute paths, '..' and the project root itself)."""
    return [cfg.outputs, cfg.artifacts]


def plan_clean(cfg: Config) -> list[dict[str, Any]]:
    plan = []
    for root in generated_paths(cfg):
        if root.is_symlink():
            plan.append({"path": str(root), "kind": "symlink", "files": 0, "bytes": 0})
        elif root.is_dir():
            files = [p for p in root.rglob("*") if p.is_file() or p.is_symlink()]
            size = sum(p.lstat().st_size for p in files)
            plan.append(
                {
                    "path": str(root),
                    "kind": "folder",
                    "files": len(files),
                    "bytes": size,
                    "list": [str(p) for p in sorted(files)],
                }
            )
        elif root.exists():
            plan.append({"path": str(root), "kind": "not a folder: left alone", "files": 0, "bytes": 0})
    return plan


def cmd_clean(args: argparse.Namespace, cfg: Config) -> int:
    plan = plan_clean(cfg)
    deleted = []
    if not args.dry_run:
        for entry in plan:
            path = Path(entry["path"])
            if entry["kind"] == "symlink":
                path.unlink()  # the link only, never what it points to
            elif entry["kind"] == "folder":
                shutil.rmtree(path)
            else:
                continue
            deleted.append(entry["path"])
    result = {
        "command": "clean",
        "scope": args.scope,
        "dry_run": args.dry_run,
        "plan": plan,
        "deleted": deleted,
    }
    if args.json:
        print_json(result)
        return 0
    if not plan:
        print("nothing to clean: " + ", ".join(f"{p}/" for p in generated_paths(cfg)) + " do not exist")
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for entry in plan:
        if entry["kind"] == "folder":
            print(f"{verb} {entry['path']}/ ({entry['files']} files, {entry['bytes'] / 1024:.1f} KiB)")
            for f in entry["list"][:50]:
                print(f"    {f}")
            if len(entry["list"]) > 50:
                print(f"    ... and {len(entry['list']) - 50} more")
        elif entry["kind"] == "symlink":
            print(f"{verb} the symlink {entry['path']} (not its target)")
        else:
            print(f"left alone {entry['path']}: {entry['kind']}")
    if args.dry_run:
        print("dry run: nothing was deleted; run without --dry-run to delete the files listed")
    return 0


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    add_common_arguments(parser, device=False)
    parser.add_argument(
        "--scope",
        choices=("generated",),
        required=True,
        help="generated: the output and artifact folders of the config (outputs/, artifacts/)",
    )
    parser.add_argument("--dry-run", action="store_true", help="list what would be deleted; delete nothing")


def run(args: argparse.Namespace) -> int:
    return run_command(args, cmd_clean)
