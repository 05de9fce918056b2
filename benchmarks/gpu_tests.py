"""A bounded run of pytest for a GPU machine (benchmarks/gpu_session.sh's test step),
and the pytest plugin that makes it so (this file, loaded with ``-p gpu_tests``).

    python benchmarks/gpu_tests.py --budget 200 --progress tests.jsonl --summary tests.json \\
        --log tests.log -- tests/kernels/test_cuda.py -k "not sm80"

What it bounds, and what it keeps:

- each test has a time limit (pytest-timeout's ``--timeout``, thread method, so a
  kernel that never returns still ends: the process is killed after printing
  every thread's stack), the whole run the budget (``timeout -k``, from outside);
- every test's start and outcome is appended to the progress file (JSON lines)
  as it happens, so whatever kills the process leaves what ran;
- a failed test on a CUDA machine is followed by a probe of the CUDA context
  (a one-element kernel and a synchronize); if that fails the error was sticky
  (every later GPU test in that process would fail with it), the run stops and
  goes on in a fresh process with the tests not yet run; so does a run whose
  process died (a per-test timeout, a crash): the test it was in is recorded as
  such and left out of the next;
- the first test that failed, in the order they ran, is the summary's
  ``first_failure``: the one that matters (a later failure may only be its
  consequence), and tests that failed after a sticky error, or were not run,
  are listed as such.

Exit status 0 when every test collected ran and none failed or errored and no
test was skipped for want of a GPU (the GPU machine is where they must run),
else 1.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

PROGRESS_ENV = "HKT_GPU_TESTS_PROGRESS"
# a comma-separated list of test names after whose failure the plugin reports a
# sticky CUDA error, as if its probe had failed: how tests/research/test_gpu_session.py
# exercises the restart without a GPU
FAKE_STICKY_ENV = "HKT_GPU_TESTS_FAKE_STICKY"
GPU_SKIP_REASON = "needs a CUDA GPU"


# ---- the plugin (runs inside pytest)

def _emit(event, path=None):
    path = path or os.environ.get(PROGRESS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")
            f.flush()


def _read_progress(path):
    events = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:  # a line cut short by a kill
                    pass
    return events


def _cuda_context_broken(nodeid):
    """True when the CUDA context no longer runs work (a sticky error: illegal
    address, launch failure); False when it does, or there is no GPU."""
    if nodeid.rsplit("::", 1)[-1] in os.environ.get(FAKE_STICKY_ENV, "").split(","):
        return True
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    try:
        torch.ones(1, device="cuda").add_(1).item()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 -- any error here means the context is gone
        return True
    return False


@pytest.hookimpl(trylast=True)  # after --deselect and -k have taken theirs out
def pytest_collection_modifyitems(session, config, items):
    """Leaves out the tests an earlier process of this run already ran (or died
    in), records what was collected, and moves torch.compile's tests (the slow
    ones) last, so that a short budget spends itself on the kernels first."""
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    done = {e["nodeid"] for e in _read_progress(path) if e.get("event") in ("result", "died")}
    keep = [it for it in items if it.nodeid not in done]
    left = [it for it in items if it.nodeid in done]
    if left:
        config.hook.pytest_deselected(items=left)
    keep.sort(key=lambda it: "compile" in it.name)
    items[:] = keep
    _emit({"event": "collected", "nodeids": [it.nodeid for it in keep], "already_run": len(left)})


def pytest_runtest_logstart(nodeid, location):
    _emit({"event": "start", "nodeid": nodeid, "t": time.time()})


_outcomes = {}


def pytest_runtest_logreport(report):
    """One "result" event per test, when its teardown is reported: the worst of
    its phases (an error in setup or teardown counts as an error)."""
    o = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "duration": 0.0, "message": ""})
    o["duration"] += report.duration
    if report.failed:
        o["outcome"] = "failed" if report.when == "call" else "error"
        o["message"] = str(report.longrepr)[-3000:]
    elif report.skipped and o["outcome"] == "passed":
        o["outcome"] = "skipped"
        lr = report.longrepr
        o["message"] = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    if report.when == "teardown":
        _emit({"event": "result", "nodeid": report.nodeid, **o, "duration": round(o["duration"], 3)})


def pytest_runtest_logfinish(nodeid, location):
    o = _outcomes.get(nodeid)
    if o and o["outcome"] in ("failed", "error") and _cuda_context_broken(nodeid):
        _emit({"event": "sticky", "nodeid": nodeid})
        # every later GPU test of this process would fail with this error: stop, and
        # let the runner go on in a fresh process
        pytest.exit(f"sticky CUDA error after {nodeid}: going on in a fresh process", returncode=3)


# ---- the runner

def summarize(events, budget_left):
    collected = []
    for e in events:
        if e["event"] == "collected":
            collected += [n for n in e["nodeids"] if n not in collected]
    results, order, sticky, died = {}, [], [], []
    for e in events:
        if e["event"] == "result":
            results[e["nodeid"]] = e
            order.append(e["nodeid"])
        elif e["event"] == "died":
            results[e["nodeid"]] = {"outcome": "died", "message": e["why"]}
            order.append(e["nodeid"])
            died.append(e["nodeid"])
        elif e["event"] == "sticky":
            sticky.append(e["nodeid"])
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped", "died")}
    for r in results.values():
        counts[r["outcome"]] += 1
    bad = [n for n in order if results[n]["outcome"] in ("failed", "error", "died")]
    gpu_skipped = [n for n, r in results.items() if r["outcome"] == "skipped" and GPU_SKIP_REASON in r["message"]]
    not_run = [n for n in collected if n not in results]
    first = bad[0] if bad else None
    return {
        "collected": len(collected), **counts, "gpu_skipped": len(gpu_skipped), "not_run": not_run,
        "first_failure": {"nodeid": first, "outcome": results[first]["outcome"],
                          "message": results[first]["message"]} if first else None,
        "failed_tests": bad, "sticky_cuda_errors_after": sticky, "died_in": died,
        "slowest": sorted(((round(r.get("duration", 0), 1), n) for n, r in results.items()), reverse=True)[:10],
        "budget_left_s": round(budget_left, 1),
        "ok": bool(collected) and not bad and not not_run and not gpu_skipped,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, required=True, help="seconds for the whole run")
    ap.add_argument("--per-test", type=float, default=120.0, help="seconds one test may take")
    ap.add_argument("--progress", required=True)
    ap.add_argument("--summary", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    start = time.monotonic()
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{PROGRESS_ENV: os.path.abspath(args.progress)})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    extra = []
    if importlib.util.find_spec("pytest_timeout") is not None:
        extra = [f"--timeout={args.per_test:g}", "--timeout-method=thread"]
    else:
        print("[gpu_tests] pytest-timeout is not installed: no per-test limit, only the run's", flush=True)
    open(args.progress, "a").close()
    runs = 0
    while True:
        left = args.budget - (time.monotonic() - start)
        if left < 10:
            print(f"[gpu_tests] out of time ({args.budget:g} s)", flush=True)
            break
        runs += 1
        cmd = ["timeout", "-k", "5", f"{int(left)}", sys.executable, "-m", "pytest", "-p", "gpu_tests",
               "-p", "no:cacheprovider", "-q", "-rfE", *extra, *args.pytest_args]
        print(f"[gpu_tests] run {runs}: {' '.join(cmd)}", flush=True)
        with open(args.log, "a") as log:
            log.write(f"\n===== run {runs}: {' '.join(cmd)}\n")
            log.flush()
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        events = _read_progress(args.progress)
        finished = {e["nodeid"] for e in events if e["event"] in ("result", "died")}
        started = [e["nodeid"] for e in events if e["event"] == "start"]
        hung = [n for n in started if n not in finished]
        print(f"[gpu_tests] run {runs}: pytest exit status {rc}", flush=True)
        if rc in (124, 137):  # the run's own limit: the budget is spent
            for n in hung:
                _emit({"event": "died", "nodeid": n, "why": "the run's time budget ran out here"}, args.progress)
            break
        if hung:  # the process died inside a test (a per-test timeout kills it, or a crash): go on without it
            for n in hung:
                _emit({"event": "died", "nodeid": n,
                       "why": f"the pytest process ended inside this test (exit status {rc}: a per-test timeout, "
                              f"or a crash); see the log"}, args.progress)
            continue
        if rc == 3 and any(e["event"] == "sticky" for e in events[-3:]):
            continue
        break
    s = summarize(_read_progress(args.progress), args.budget - (time.monotonic() - start))
    s["pytest_processes"] = runs
    tmp = args.summary + ".tmp"
    with open(tmp, "w") as f:
        json.dump(s, f, indent=2)
    os.replace(tmp, args.summary)
    line = (f"{s['collected']} collected: {s['passed']} passed, {s['failed']} failed, {s['error']} errors, "
            f"{s['died']} died, {s['skipped']} skipped ({s['gpu_skipped']} for want of a GPU), "
            f"{len(s['not_run'])} not run")
    print(f"[gpu_tests] {line}", flush=True)
    if s["first_failure"]:
        print(f"[gpu_tests] FIRST FAILURE (the one that matters): {s['first_failure']['nodeid']}\n"
              f"{s['first_failure']['message'][-1500:]}", flush=True)
    for n in s["sticky_cuda_errors_after"]:
        print(f"[gpu_tests] a sticky CUDA error followed {n}: the tests after it ran in a fresh process", flush=True)
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
