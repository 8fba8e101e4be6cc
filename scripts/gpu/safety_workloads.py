"""PyTorch job shapes for the safety scenarios of docs/safety.md, on a real GPU.

    python3 safety_workloads.py fork     [--gib 4] [--children 2] [--device 0] [--helper] [--ignore-sigterm]
    python3 safety_workloads.py zombie   [--gib 4] [--children 2] [--device 0]
    python3 safety_workloads.py launcher [--gib 1] [--children 1] [--device 0]

fork: allocate, fork children that inherit the CUDA descriptors (as DataLoader
workers without persistent shutdown do), print "ready PID CHILD...", sleep.
With --helper, also double-fork a helper that keeps the trainer's open files,
reparented to init in the trainer's process group, and print "helper PID".
With --ignore-sigterm, the children ignore SIGTERM (SIGKILL still ends them).
zombie: the same, then start a thread that keeps running and end the main
thread alone with pthread_exit: /proc shows the process as Z while it lives
and keeps its context.
launcher: as torchrun does, call cuInit(0) alone (descriptors open, the
device mapped, no context), print "launcher PID", then start one rank (this
script in fork mode, its own context) as a child and wait for it.
"""
import argparse, ctypes, os, signal, subprocess, sys, threading, time

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["fork", "zombie", "launcher"])
ap.add_argument("--gib", type=float, default=4)
ap.add_argument("--children", type=int, default=2)
ap.add_argument("--device", type=int, default=0)
ap.add_argument("--helper", action="store_true")
ap.add_argument("--ignore-sigterm", action="store_true")
a = ap.parse_args()

if a.mode == "launcher":
    if ctypes.CDLL("libcuda.so.1").cuInit(0) != 0:
        sys.exit("cuInit failed")
    print("launcher", os.getpid(), flush=True)
    rank = subprocess.Popen([sys.executable, __file__, "fork", "--gib", str(a.gib), "--children", str(a.children),
                             "--device", str(a.device)])
    sys.exit(rank.wait())

import torch

x = torch.empty(int(a.gib * (1 << 30)), dtype=torch.uint8, device=f"cuda:{a.device}")
x.fill_(1)
torch.cuda.synchronize()
kids = []
for _ in range(a.children):
    pid = os.fork()
    if pid == 0:
        if a.ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(3600)
    kids.append(pid)

helper = 0
if a.helper:
    r, w = os.pipe()
    mid = os.fork()
    if mid == 0:
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            while True:
                time.sleep(3600)
        os._exit(0)
    os.waitpid(mid, 0)
    os.close(w)
    helper = int(os.read(r, 32))


def hold():
    while True:
        time.sleep(3600)
        x.add_(0)  # keeps the tensor, and so the context, referenced


if a.mode == "zombie":
    threading.Thread(target=hold, daemon=False).start()
print("ready", os.getpid(), *kids, flush=True)
if helper:
    print("helper", helper, flush=True)
if a.mode == "zombie":
    time.sleep(0.5)
    ctypes.CDLL(None).pthread_exit(None)  # the main thread alone exits
hold()
