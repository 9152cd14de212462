"""`check-checkpoints`: reload the saved training checkpoints and compare."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from rmsnorm_suite.config import Config
from rmsnorm_suite.console import (
    DeviceUnavailable,
    add_common_arguments,
    fail,
    fmt,
    format_table,
    print_json,
    resolve_device,
    run_command,
    write_json,
)


def checkpoint_checks(cfg: Config, device_request: str = "auto") -> dict[str, Any]:
    """Reload every checkpoint train-integration saved; each must reproduce its recorded parameter
    digest and its recorded test predictions exactly (zero difference)."""
    from rmsnorm_suite.training import (
        CHECKPOINT_DIR,
        RESULT_JSON,
        load_checkpoint,
        make_splits,
        splits_digest,
        state_digest,
    )

    folder = cfg.artifacts / CHECKPOINT_DIR
    files = sorted(folder.glob("*.pt")) if folder.is_dir() else []
    result: dict[str, Any] = {
        "command": "check-checkpoints",
        "folder": str(folder),
        "checkpoints": [],
        "passed": False,
    }
    if not files:
        result["error"] = f"no checkpoints in {folder}/ (run train-integration first)"
        return result
    record = {}
    log = cfg.outputs / RESULT_JSON
    if log.is_file():
        record = {Path(v["file"]).name: v for v in json.loads(log.read_text())["checkpoints"].values()}
    splits = make_splits(cfg)
    digest = splits_digest(splits)
    test_x = splits["test"][0]
    try:
        kernel_device, device_error = resolve_device(device_request, "check-checkpoints"), None
    except DeviceUnavailable as exc:
        kernel_device, device_error = None, str(exc)
        result["device_error"] = device_error
    ok = True
    for file in files:
        entry: dict[str, Any] = {"file": str(file)}
        result["checkpoints"].append(entry)
        try:
            payload = torch.load(file, map_location="cpu", weights_only=True)
            meta = payload["meta"]
            entry.update(path=meta["path"], step=payload["step"], written_on=meta["device"])
            if meta.get("splits_digest") != digest:
                raise ValueError(
                    f"trained on other data than {cfg.source} describes (data section or seeds differ)"
                )
            if meta["path"] == "kernel":
                if kernel_device is None:
                    raise DeviceUnavailable(
                        "the kernel path needs CUDA or the Triton interpreter (see below)"
                    )
                device = kernel_device
            else:  # the reference path runs anywhere; reproduce it where it was written
                device = "cuda" if meta["device"] == "cuda" and torch.cuda.is_available() else "cpu"
            if meta["device"] != device:
                raise DeviceUnavailable(
                    f"written on {meta['device']}; its outputs are reproduced bitwise only there, "
                    f"and this machine runs it on {device}"
                )
            run, payload = load_checkpoint(file, device)
            run.model.eval()
            with torch.no_grad():
                out = run.model(test_x.to(device)).cpu()
            entry.update(
                device=device,
                digest_matches_checkpoint=state_digest(run.model) == payload["digest"],
                max_abs_output_diff=(out - payload["test_predictions"]).abs().max().item(),
            )
            if file.name in record and "digest" in record[file.name]:
                entry["digest_matches_training_log"] = record[file.name]["digest"] == payload["digest"]
            entry["passed"] = (
                entry["digest_matches_checkpoint"]
                and entry["max_abs_output_diff"] == 0.0
                and entry.get("digest_matches_training_log", True)
            )
        except (DeviceUnavailable, KeyError, RuntimeError, ValueError) as exc:
            entry["passed"] = False
            entry["error"] = (
                str(exc)
                if isinstance(exc, DeviceUnavailable | ValueError)
                else f"{type(exc).__name__}: {exc}"
            )
        ok = ok and entry["passed"]
    result["passed"] = ok
    return result


def cmd_check_checkpoints(args: argparse.Namespace, cfg: Config) -> int:
    result = checkpoint_checks(cfg, args.device)
    out = write_json(cfg.outputs / "check-checkpoints.json", result)
    if args.json:
        print_json(result)
        return 0 if result["passed"] else 1
    if "error" in result:
        return fail(result["error"], 1)
    rows = []
    for e in result["checkpoints"]:
        if "error" in e:
            rows.append(
                [
                    Path(e["file"]).name,
                    e.get("path", "-"),
                    e.get("step", "-"),
                    "-",
                    "-",
                    f"FAIL: {e['error']}",
                ]
            )
            continue
        rows.append(
            [
                Path(e["file"]).name,
                e["path"],
                e["step"],
                "same"
                if e["digest_matches_checkpoint"] and e.get("digest_matches_training_log", True)
                else "DIFFERENT",
                fmt(e["max_abs_output_diff"]),
                "pass" if e["passed"] else "FAIL",
            ]
        )
    print(format_table(["checkpoint", "path", "step", "parameters", "max |output diff|", "status"], rows))
    if result.get("device_error") and any("error" in e for e in result["checkpoints"]):
        print(f"\nDIAGNOSIS: {result['device_error']}")
    print(f"\n{'PASS' if result['passed'] else 'FAIL'}: details in {out}")
    return 0 if result["passed"] else 1


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    add_common_arguments(parser, device=True)


def run(args: argparse.Namespace) -> int:
    return run_command(args, cmd_check_checkpoints)
