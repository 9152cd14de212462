"""A command in a sandbox, and the lines it and the judge exchange.

The judge starts a sandbox (:mod:`rmsnorm_suite.sandbox`) under resource caps, gives it one line
on standard input, and reads what comes back on a pipe of its own: the results, and for the
judge's stopwatch (:mod:`rmsnorm_suite.stopwatch`) an answer to each line the judge writes, timed
by the judge's clock from writing the line to the answer's arrival. Nothing the sandbox writes
elsewhere is read; what it prints is kept up to a cap.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rmsnorm_suite import sandbox, telemetry

OUTPUT_CAP = 64 * 2**20  # bytes of results, and of each of stdout and stderr, a sandbox may hand back
FILE_CAP = 1 * 2**30  # RLIMIT_FSIZE of the sandbox's processes (prlimit): no file past it, stdout included
PROC_CAP = 4096  # RLIMIT_NPROC of its user's processes and threads (prlimit): a fork bomb stops there


def _tail_of(f) -> str:
    """The last OUTPUT_CAP bytes a sandbox wrote to ``f``, as text."""
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - OUTPUT_CAP))
    return f.read().decode("utf-8", errors="replace")


@dataclass
class Answer:
    """What a sandbox gave back: exit status (None on timeout), stdout, stderr, the lines that
    came on the result pipe, and per stopwatch line the judge's seconds from writing it to the
    next line's arrival (None where that line was not answered in turn)."""

    code: int | None
    out: str
    err: str
    lines: list[str]
    seconds: list[float | None] = dataclasses.field(default_factory=list)


def sandboxed(
    box: sandbox.Sandbox,
    argv: Sequence[str],
    stdin: Callable[[int], str],
    timeout: float,
    hidden: Sequence[Path] = (),
    watch: telemetry.Sampler | None = None,
    exchange: Callable[[int, str], str | None] | None = None,
) -> Answer:
    """Run ``argv`` in ``box``, its standard input the line ``stdin(fd)`` where ``fd`` is the
    write end of a result pipe open inside. With ``exchange``: after the pipe's line ``k`` (from
    1) has come, ``exchange(k, that line)`` is written to standard input and the judge's clock runs
    until line ``k + 1`` arrives (the stopwatch); None ends the exchange. A line that arrives
    before the judge wrote what it answers is refused. A timeout kills the sandbox's whole
    process group. ``watch`` samples the GPU while it runs."""
    read, write = os.pipe()
    chunks: list[bytes] = []
    arrivals: queue.Queue[tuple[float, bytes | None]] = queue.Queue()  # (judge's clock, line)

    def drain() -> None:  # at most OUTPUT_CAP kept: a flood is cut, not held in memory
        kept, partial = 0, b""
        while block := os.read(read, 1 << 16):
            now = time.perf_counter()
            if kept < OUTPUT_CAP:
                chunks.append(block[: OUTPUT_CAP - kept])
                kept += len(block)
                *done, partial = (partial + block).split(b"\n")
                for text in done:
                    arrivals.put((now, text))
        os.close(read)
        arrivals.put((time.perf_counter(), None))

    def next_line(until: float) -> tuple[float, bytes] | None:  # the next line and when it came
        try:
            when, text = arrivals.get(timeout=max(until - time.monotonic(), 0.0))
        except queue.Empty:
            return None
        return None if text is None else (when, text)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    until = time.monotonic() + max(timeout, 0.01)
    seconds: list[float | None] = []
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        try:
            proc = subprocess.Popen(
                ["prlimit", f"--fsize={FILE_CAP}", f"--nproc={PROC_CAP}", "--", *sandbox.command(box, argv, hidden=hidden)],
                stdin=subprocess.PIPE, stdout=out_file,
                stderr=err_file, start_new_session=True, pass_fds=(write,),
            )  # fmt: skip
        finally:
            os.close(write)
        if watch is not None:
            watch.start(proc.pid)
        try:
            proc.stdin.write(stdin(write).encode() + b"\n")
            proc.stdin.flush()
            k, got = 1, next_line(until) if exchange is not None else None
            collecting = gc.isenabled()
            gc.disable()  # the judge's clock runs below: no collection of its heap inside it
            try:
                while got is not None and (say := exchange(k, got[1].decode("utf-8", "replace"))) is not None:
                    if not arrivals.empty():  # a line already on its way answers nothing yet asked
                        seconds.append(None)
                        break
                    started = time.perf_counter()  # before the write: a loaded judge may run late
                    proc.stdin.write(say.encode() + b"\n")
                    proc.stdin.flush()
                    got = next_line(until)
                    seconds.append(got[0] - started if got is not None and got[0] > started else None)
                    k += 1
            finally:
                if collecting:
                    gc.enable()
            proc.stdin.close()
        except BrokenPipeError:  # it exited before reading: its status says why
            pass
        try:
            code: int | None = proc.wait(timeout=max(until - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            code = None
        if watch is not None:
            watch.stop()
        out, err = _tail_of(out_file), _tail_of(err_file)
    reader.join(timeout=30)
    if sum(map(len, chunks)) >= OUTPUT_CAP:
        return Answer(code, out, err + f"\nresults pipe: more than {OUTPUT_CAP} bytes, cut", [])
    text = b"".join(chunks).decode("utf-8", errors="replace")
    return Answer(code, out, err, text.splitlines(), seconds)
