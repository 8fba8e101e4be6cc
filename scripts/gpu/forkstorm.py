#!/usr/bin/env python3
"""A fork storm at a fixed rate: RATE short-lived processes a second
(posix_spawn of /bin/true, each reaped) for SECONDS, from WORKERS processes
that each keep an even share of the pace. Issue 22's cost is asked at 5,000
a second; shell loops of /bin/true run as fast as the machine lets them
(8,000-9,600 a second on the H200), which measures a different load.

Usage: forkstorm.py RATE SECONDS [WORKERS]   (prints the rate achieved)
"""
import os
import sys
import time


def worker(rate, seconds):
    interval = 1.0 / rate
    start = time.monotonic()
    n = 0
    while True:
        due = start + n * interval
        now = time.monotonic()
        if now - start >= seconds:
            break
        if due > now:
            time.sleep(due - now)
        pid = os.posix_spawn("/bin/true", ["true"], {})
        os.waitpid(pid, 0)
        n += 1
    return n


def main():
    rate, seconds = float(sys.argv[1]), float(sys.argv[2])
    workers = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    r, w = os.pipe()
    t0 = time.monotonic()
    children = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            n = worker(rate / workers, seconds)
            os.write(w, b"%d\n" % n)
            os._exit(0)
        children.append(pid)
    os.close(w)
    for pid in children:
        os.waitpid(pid, 0)
    elapsed = time.monotonic() - t0
    with os.fdopen(r) as f:
        total = sum(int(line) for line in f)
    print("forkstorm: %d processes in %.1f s, %.0f a second (asked %.0f, %d workers)"
          % (total, elapsed, total / elapsed, rate, workers))
    if total / elapsed < 0.95 * rate:
        print("forkstorm: below the asked rate: the machine cannot keep it")
        sys.exit(1)


if __name__ == "__main__":
    main()
