"""The hostile-head catalogue: attacks a pull request's op can make on the judge, each as text
appended to the module that defines the op's public ``rms_norm`` (of a head that is also slow).
tests/suite/test_hostile_heads.py runs them on CPU; tools/gate_rehearsal.py catalogue on a GPU.
``{verdict}``: the verdict file the judge will write; ``{marker}``: a file a surviving process
would write; ``{token}``: a word in the command line of every process an attack starts."""

from tests.suite._fixtures import MANY_ROW_PLAN, OPS, OPS_RESIDUAL

# A daemon outside the worker's process group: for a minute it rewrites the base's staged op
# (slow), the trusted suite's gate and the verdict file, and leaves a marker.
_WRITER = (
    "import glob, pathlib, time\n"
    "for _ in range(600):\n"
    "    for p in glob.glob('{staging}/path/base/rmsnorm_kernel/__init__.py'):\n"
    "        pathlib.Path(p).write_text('import time\\\\ntime.sleep(600)\\\\n')\n"
    "    for p in glob.glob('/judge/suite/rmsnorm_suite/gate.py') + glob.glob('{verdict}'):\n"
    "        pathlib.Path(p).write_text('forged')\n"
    "    pathlib.Path('{marker}').write_text('alive')\n"
    "    time.sleep(0.1)\n"
)
# Loads the machine for a minute: the GPU where there is one, else a core.
_SPINNER = (
    "import time\nend = time.time() + 60\n"
    "try:\n    import torch\n    assert torch.cuda.is_available()\n"
    "    while time.time() < end:\n        torch.cuda._sleep(10**7)\n        torch.cuda.synchronize()\n"
    "except Exception:\n    while time.time() < end:\n        pass\n"
)

ATTACKS = {
    # the clocks scaled at import (the head that got PASS before the sandbox)
    "clock-at-import": (
        "import time as _t\n_real = _t.perf_counter\n_t.perf_counter = lambda: _real() * 0.45\n"
        "import torch as _torch\n_elapsed = _torch.cuda.Event.elapsed_time\n"
        "_torch.cuda.Event.elapsed_time = lambda self, end: _elapsed(self, end) * 0.45\n"
    ),
    # the clocks scaled from a thread, once the first timed call has run
    "clock-from-a-thread": (
        "import threading, time as _t\n_real, _first = _t.perf_counter, threading.Event()\n"
        "def _patch():\n    _first.wait()\n    _t.perf_counter = lambda: _real() * 0.45\n"
        "    import torch\n    _e = torch.cuda.Event.elapsed_time\n"
        "    torch.cuda.Event.elapsed_time = lambda self, end: _e(self, end) * 0.45\n"
        "threading.Thread(target=_patch, daemon=True).start()\n"
        "_slow = rms_norm\n"
        "def rms_norm(*a, **k):\n    _first.set()\n    return _slow(*a, **k)\n"
    ),
    # the trusted harness's functions keep their identity; their code is swapped
    "harness-code-swapped": (
        "import rmsnorm_suite.timing as _t\ndef _fast(values):\n    return 1e-6\n"
        "_t.median.__code__ = _fast.__code__\n"
    ),
    "left-behind-writer": (
        "import os as _os, subprocess as _sp, sys as _sys\n"
        f"_code = {_WRITER!r}\n"
        "if not _os.environ.get('RMSNORM_WRITER'):\n"
        "    _os.environ['RMSNORM_WRITER'] = '1'\n"
        "    _sp.Popen([_sys.executable, '-c', _code.format(verdict='{verdict}', marker='{marker}'), '{token}'],\n"
        "              start_new_session=True, stdout=_sp.DEVNULL, stderr=_sp.DEVNULL)\n"
    ),
    # the harness's recorded times scaled down through the caller's frames (nothing replaced)
    "frames-rewrite": (
        "import sys as _sys\n_done = {}\n"
        "def _scale(values):\n"
        "    if isinstance(values, list) and values and all(type(v) is float for v in values):\n"
        "        start = _done.get(id(values), 0)\n        start = 0 if start > len(values) else start\n"
        "        for i in range(start, len(values)):\n            values[i] *= _FACTOR\n"
        "        _done[id(values)] = len(values)\n"
        "def _forge():\n    frame = _sys._getframe(2)\n    while frame is not None:\n"
        "        for name, value in list(frame.f_locals.items()):\n"
        "            if name in ('times', 'host'):\n                _scale(value)\n"
        "            if name == 'by_key' and isinstance(value, dict):\n"
        "                for tally in value.values():\n"
        "                    for attr, lst in vars(tally).items():\n"
        "                        if attr.endswith('_ms'):\n                            _scale(lst)\n"
        "        frame = frame.f_back\n"
        "try:\n    import torch as _torch\n    _FACTOR = 0.45 if _torch.cuda.is_available() else 0.001\n"
        "except Exception:\n    _FACTOR = 0.001\n"
        "_slow = rms_norm\n"
        "def rms_norm(*a, **k):\n    _forge()\n    return _slow(*a, **k)\n"
    ),
    # outputs kept per input tensor: a timing loop that calls again on the same inputs is served
    # from the cache (forward only; a call that needs gradients is left alone)
    "cached-outputs": (
        "_cache = {}\n_slow = rms_norm\n"
        "def rms_norm(*a, **k):\n"
        "    args = list(a) + list(k.values())\n"
        "    tensors = [v for v in args if hasattr(v, 'data_ptr')]\n"
        "    if any(t.requires_grad for t in tensors):\n        return _slow(*a, **k)\n"
        "    key = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in tensors)\n"
        "    key += tuple(repr(v) for v in args if not hasattr(v, 'data_ptr'))\n"
        "    if key not in _cache:\n        _cache.clear()\n        _cache[key] = _slow(*a, **k)\n"
        "    return _cache[key]\n"
    ),
    # the stopwatch's calls served by a fast stand-in (the module global the worker calls)
    "stopwatch-swapped": (
        "import types as _types, rmsnorm_suite.worker as _w, rmsnorm_suite.stopwatch as _sw\n"
        "_fake = lambda fn, blocks, seed, device: _types.SimpleNamespace(block=lambda i, go: [0.0, 0.0])\n"
        "_w.stopwatch = _types.SimpleNamespace(plan=_sw.plan, Stopwatch=_fake)\n"
    ),
    # the stopwatch's instance reached through the frames in its untimed warm-up, its block
    # method replaced by one that answers without calling the op
    "stopwatch-served": (
        "import sys as _sys, types as _types\n_slow = rms_norm\n"
        "def _served(self, i, seed):\n    return [0.0] * (2 if self.blocks[i].mode == 'forward' else 4)\n"
        "def rms_norm(*a, **k):\n    f = _sys._getframe(1)\n    while f is not None:\n"
        "        s = f.f_locals.get('self')\n"
        "        if type(s).__name__ == 'Stopwatch' and 'block' not in vars(s):\n"
        "            s.block = _types.MethodType(_served, s)\n"
        "        f = f.f_back\n    return _slow(*a, **k)\n"
    ),
    # during the stopwatch (seen from the caller's frame) no normalisation at all: y = x * w
    "wrong-op-in-stopwatch": (
        "import sys as _sys\n_slow = rms_norm\n"
        "def rms_norm(x, *a, **k):\n"
        "    if _sys._getframe(1).f_globals.get('__name__') == 'rmsnorm_suite.stopwatch' or "
        "_sys._getframe(2).f_globals.get('__name__') == 'rmsnorm_suite.stopwatch':\n"
        "        w = k.get('weight', a[1] if len(a) > 1 else None)\n"
        "        return x * w if w is not None and getattr(w, 'dim', lambda: 0)() == 1 else x\n"
        "    return _slow(x, *a, **k)\n"
    ),
    # an answer written to the result pipe before the judge's go, from a thread
    "answer-before-go": (
        "import json as _json, os as _os, sys as _sys, threading as _th, time as _time\n_write = _os.write\n"
        "def _early():\n    main = _th.main_thread().ident\n    while True:\n"
        "        frame = _sys._current_frames().get(main)\n"
        "        while frame is not None and frame.f_code.co_name != 'answer_stopwatch':\n"
        "            frame = frame.f_back\n"
        "        if frame is not None:\n"
        "            _write(frame.f_locals['pipe'].fileno(), (_json.dumps({'seed': 0, 'sums': []}) + '\\n').encode())\n"
        "            return\n"
        "        _time.sleep(0.001)\n"
        "_th.Thread(target=_early, daemon=True).start()\n"
    ),
    # left behind to load the GPU while the base's rounds run
    "spins-during-the-base": (
        "import subprocess as _sp, sys as _sys\n"
        f"_code = {_SPINNER!r}\n"
        "for _ in range(2):\n"
        "    _sp.Popen([_sys.executable, '-c', _code, '{token}'], start_new_session=True)\n"
    ),
}
# Attacks that replace nothing the guard holds: only the judge's stopwatch can see them.
STOPWATCH_ONLY = ("frames-rewrite", "cached-outputs")
# Attacks in the tree rather than in the op's code.
LINKED_PACKAGE = "symlinked-package"  # src/rmsnorm_kernel a link to a folder elsewhere
LINKED_MODULE = "symlinked-module"  # one module of the op a link out of the repository
HEAD_CONFTEST = "head-conftest"  # a tests/conftest.py that turns failed GPU tests into success
CONFTEST = (
    "import pathlib\npathlib.Path('{marker}').write_text('head conftest ran')\n"
    "def pytest_sessionfinish(session, exitstatus):\n    session.exitstatus = 0\n"
)
FAILING_GPU_TEST = (
    "import pytest\n@pytest.mark.gpu\ndef test_head_is_slow():\n    assert False, 'head is slow'\n"
)


STAGING = "/tmp/rmsnorm-pr-verdict-*"  # where the judge stages the commits (a glob)


def attack(name: str, verdict: str, marker: str, token: str, staging: str = STAGING) -> str:
    """The text of an op-code attack, its paths filled in (``staging``: what the writer aims at;
    a run outside a sandbox aims it at a folder of its own, never at a judge running beside it)."""
    text = ATTACKS[name].replace("{verdict}", verdict).replace("{marker}", marker)
    return text.replace("{token}", token).replace("{staging}", staging)


# Attacks on the inference features' rows, each (the head's stand-in ops.py, text appended to it):
# tests/suite/test_feature_attacks.py runs them on CPU, tools/gate_rehearsal.py features on a GPU.
FEATURE_ATTACKS = {
    # the check's function swapped in inference.CHECKS (a dict the guard does not hold)
    "check-table-swapped": (
        MANY_ROW_PLAN,
        "from rmsnorm_suite import inference as _inf\n"
        "_inf.CHECKS['batch'] = lambda impl, device, cases: "
        "_inf.Finding('batch invariance', {'batch_invariance': 0.0})\n",
    ),
    # the check's cases swapped for a batch of one row (plain dicts the guard does not hold)
    "case-table-swapped": (
        MANY_ROW_PLAN,
        "import torch as _torch\nfrom rmsnorm_suite import inference as _inf\n"
        "for _t in (_inf.HOST_CASES, *_inf.CASES.values()):\n"
        "    _t['batch'] = (_inf.BatchCase(1, 64, _torch.float32, False),)\n",
    ),
    # the figures rewritten on their way to the results: dataclasses.replace is not held
    "dataclasses-replace-forges-figures": (
        MANY_ROW_PLAN,
        "import dataclasses as _dc\n_real_replace = _dc.replace\n"
        "def _replace(obj, /, **kw):\n"
        "    if 'features' in kw:\n"
        "        kw['features'] = {k: type(v)('ok', 0.0, v.note) if v.status == 'ok' else v\n"
        "                          for k, v in kw['features'].items()}\n"
        "    return _real_replace(obj, **kw)\n"
        "_dc.replace = _replace\n",
    ),
    # the check's Finding reached through the caller's frames: its figures dict made to store 0
    "finding-rewritten-through-frames": (
        MANY_ROW_PLAN,
        "import sys as _sys\n"
        "class _Zero(dict):\n"
        "    def __setitem__(self, k, v):\n        dict.__setitem__(self, k, 0.0)\n"
        "def _forge():\n    f = _sys._getframe(1)\n    while f is not None:\n"
        "        fd = f.f_locals.get('finding')\n"
        "        if hasattr(fd, 'figures') and not isinstance(fd.figures, _Zero):\n"
        "            fd.figures = _Zero(fd.figures)\n"
        "        f = f.f_back\n"
        "_plan = rms_norm\n"
        "def rms_norm(x, *a, **k):\n    if x.shape[0] >= 257:\n        _forge()\n"
        "    return _plan(x, *a, **k)\n",
    ),
    # outputs returned as a Tensor subclass whose != says "equal": nothing patched at all. The
    # no-grad (inference) path is batch dependent; the autograd path is not.
    "tensor-subclass-hides-bits": (
        OPS_RESIDUAL,
        "class _Same(torch.Tensor):\n"
        "    @classmethod\n"
        "    def __torch_function__(cls, func, types, args=(), kwargs=None):\n"
        "        if func in (torch.Tensor.__ne__, torch.Tensor.ne, torch.ne):\n"
        "            with torch._C.DisableTorchFunctionSubclass():\n"
        "                return torch.zeros(args[0].shape, dtype=torch.bool)\n"
        "        return super().__torch_function__(func, types, args, kwargs or {})\n"
        "_plain = rms_norm\n"
        "def rms_norm(x, weight=None, eps=1e-6, residual=None):\n"
        "    if torch.is_grad_enabled() or x.shape[0] < 257:\n"
        "        return _plain(x, weight, eps, residual)\n"
        "    with torch.no_grad():\n"
        "        h = x if residual is None else (x.float() + residual.float()).to(x.dtype)\n"
        "        y = h * (h.double().pow(2).mean(-1, keepdim=True).to(h.dtype) + eps).rsqrt()\n"
        "        y = (y * weight if weight is not None else y).as_subclass(_Same)\n"
        "    return y if residual is None else (y, h.as_subclass(_Same))\n",
    ),
    # head drops the residual that base has: the residual case is "unsupported", the plain one
    # measured, and the figure is "ok" (docs/gate.md: a feature base has and head lacks is a
    # regression)
    "residual-dropped": (OPS.format(cost=0.0), ""),
    # an AttributeError in the op (the commonest Python bug) on a batch of 7 rows: counted as
    # "not supported", the 1-row pick measured, the row passes
    "crash-on-seven-rows-as-unsupported": (
        OPS_RESIDUAL,
        "_plain = rms_norm\n"
        "def rms_norm(x, *a, **k):\n"
        "    if x.shape[0] == 7:\n"
        "        raise AttributeError(\"'NoneType' object has no attribute 'stride'\")\n"
        "    return _plain(x, *a, **k)\n",
    ),
}
