"""Links from a verdict row to its benchmark's history on the asv page (GitHub Pages).

Imported by post_verdict_comment.py and drift_issue.py; standard library only.
"""

from __future__ import annotations

import re

# The history page on GitHub Pages: https://OWNER.github.io/REPO/ (owner lowercased by the workflow).
PAGES_URL = re.compile(r"https://[a-z0-9][a-z0-9-]{0,38}\.github\.io/(?!\.{1,2}/)[A-Za-z0-9_.-]{1,100}/")
SHAPE = re.compile(r"[0-9]+x[0-9]+-(float32|float16|bfloat16)")  # cases.BENCH_SHAPES names
# A gate row's check name -> the asv benchmark that tracks it (benchmarks/bench_rmsnorm.py):
# "latency SHAPE MODE" is the whole-call median, "device SHAPE MODE" the GPU-time median,
# "host SHAPE MODE" the host-time median, "error Q SHAPE" the error of quantity Q in the class
# whose mode computes it.
ASV_CLASS = {"forward": "Forward", "forward_backward": "ForwardBackward"}
ASV_TRACK = {"latency": "track_median_ms", "device": "track_gpu_median_ms", "host": "track_host_median_ms"}
ASV_ERROR = {"y": "Forward.track_error_y", "dx": "ForwardBackward.track_error_dx",
             "dw": "ForwardBackward.track_error_dw"}  # fmt: skip


def history_url(check: str, pages: str) -> str:
    """The asv page of the benchmark behind ``check`` at its shape, or "" when there is none.

    The URL is composed only of ``pages`` (matching PAGES_URL), constants of this script and a
    shape matching SHAPE: nothing else of the check name reaches it."""
    if not PAGES_URL.fullmatch(pages):
        return ""
    words = check.split(" ")
    if len(words) == 3 and words[0] in ASV_TRACK and words[2] in ASV_CLASS:
        benchmark, shape = f"{ASV_CLASS[words[2]]}.{ASV_TRACK[words[0]]}", words[1]
    elif len(words) == 3 and words[0] == "error" and words[1] in ASV_ERROR:
        benchmark, shape = ASV_ERROR[words[1]], words[2]
    else:
        return ""
    if not SHAPE.fullmatch(shape):
        return ""
    return f"{pages}#bench_rmsnorm.{benchmark}?p-shape='{shape}'"
