#!/usr/bin/python3
"""What one machine allows for a process per call: the ceiling of issue 6's
throughput target, measured without DSec.

Issue 6 asks for 200 calls/s of `python3 -c 'print(1)'` with 64 callers.
Every isolated call needs at least one new process. This script measures,
on the bare host, how many calls per second the machine sustains when P
workers run in parallel, each doing one of:

  spawn      posix_spawn `/usr/bin/python3 -c 'print(1)'`, wait: what the
             host row of fnbench and any process-per-call sandbox pays.
  fork-run   fork a warm interpreter, the child runs the compiled
             `print(1)` into a pipe and leaves with os._exit: a fork
             server, the cheapest Python call that still gets a fresh
             process (no interpreter start-up, no finalisation).
  fork-exit  fork a warm interpreter, the child leaves at once: the floor
             of anything that forks Python per call.

and reports calls/s (all workers together), CPU ms per call and minor page
faults per call. No sandbox, no agent, no RPC: DSec can only be slower.

    /usr/bin/python3 bench/fnbench/ceiling.py [--seconds 5] [--workers 1,2,4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import time

PY = "/usr/bin/python3"
CODE = compile("print(1)", "<string>", "exec")


def spawn_once(devnull: int) -> None:
    pid = os.posix_spawn(PY, [PY, "-c", "print(1)"], os.environ,
                         file_actions=[(os.POSIX_SPAWN_DUP2, devnull, 1)])
    os.waitpid(pid, 0)


def fork_run_once(devnull: int) -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 1)
        exec(CODE, {"__name__": "__main__"})
        os.sys.stdout.flush()
        os._exit(0)
    os.close(w)
    while os.read(r, 4096):
        pass
    os.close(r)
    os.waitpid(pid, 0)


def fork_exit_once(devnull: int) -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


KINDS = {"spawn": spawn_once, "fork-run": fork_run_once, "fork-exit": fork_exit_once}


def worker(kind: str, start: float, stop: float, out) -> None:
    once = KINDS[kind]
    devnull = os.open("/dev/null", os.O_WRONLY)
    while time.time() < start:
        time.sleep(0.001)
    n = 0
    while time.time() < stop:
        once(devnull)
        n += 1
    out.put(n)


def measure(kind: str, workers: int, seconds: float) -> tuple[float, float, float]:
    out = mp.Queue()
    start = time.time() + 0.5
    stop = start + seconds
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = [mp.Process(target=worker, args=(kind, start, stop, out)) for _ in range(workers)]
    for p in procs:
        p.start()
    n = sum(out.get() for _ in procs)
    for p in procs:
        p.join()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    flt = r1.ru_minflt - r0.ru_minflt
    return n / seconds, cpu / n * 1e3, flt / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="timed seconds per row (default 5)")
    ap.add_argument("--workers", default="1,2,4", help="parallel workers per row, comma-separated (default 1,2,4)")
    ap.add_argument("--kinds", default="spawn,fork-run,fork-exit", help="rows (default all)")
    a = ap.parse_args()
    mp.set_start_method("fork")
    print(f"host: {os.uname().release}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print(f"{'kind':>10} {'workers':>7} {'calls/s':>8} {'cpu ms/call':>11} {'minflt/call':>11}")
    for kind in a.kinds.split(","):
        for w in (int(x) for x in a.workers.split(",")):
            rate, cpu, flt = measure(kind, w, a.seconds)
            print(f"{kind:>10} {w:>7} {rate:>8.1f} {cpu:>11.2f} {flt:>11.0f}", flush=True)


if __name__ == "__main__":
    main()
