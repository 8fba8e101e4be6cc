"""PyTorch job shapes for the safety scenarios of docs/safety.md, on a real GPU.

    python3 safety_workloads.py fork   [--gib 4] [--children 2] [--device 0]
    python3 safety_workloads.py zombie [--gib 4] [--children 2] [--device 0]

fork: allocate, fork children that inherit the CUDA descriptors (as DataLoader
workers without persistent shutdown do), print "ready PID CHILD...", sleep.
zombie: the same, then start a thread that keeps running and end the main
thread alone with pthread_exit: /proc shows the process as Z while it lives
and keeps its context.
"""
import argparse, ctypes, os, threading, time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["fork", "zombie"])
ap.add_argument("--gib", type=float, default=4)
ap.add_argument("--children", type=int, default=2)
ap.add_argument("--device", type=int, default=0)
a = ap.parse_args()

x = torch.empty(int(a.gib * (1 << 30)), dtype=torch.uint8, device=f"cuda:{a.device}")
x.fill_(1)
torch.cuda.synchronize()
kids = []
for _ in range(a.children):
    pid = os.fork()
    if pid == 0:
        while True:
            time.sleep(3600)
    kids.append(pid)


def hold():
    while True:
        time.sleep(3600)
        x.add_(0)  # keeps the tensor, and so the context, referenced


if a.mode == "zombie":
    threading.Thread(target=hold, daemon=False).start()
print("ready", os.getpid(), *kids, flush=True)
if a.mode == "zombie":
    time.sleep(0.5)
    ctypes.CDLL(None).pthread_exit(None)  # the main thread alone exits
hold()
