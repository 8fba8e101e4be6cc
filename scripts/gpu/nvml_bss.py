"""Where NVML's memory in a process comes from (docs/benchmarks.md, "The
floor"). Run on a GPU node, as root, with nothing else needed but Python:

  python3 nvml_bss.py lifecycle   # RSS after dlopen, nvmlInit, reads,
                                  # nvmlShutdown and dlclose
  python3 nvml_bss.py noattach    # the same with NVML_INIT_FLAG_NO_ATTACH
  python3 nvml_bss.py zero-pages  # hands back the pages of NVML's BSS that
                                  # hold zeros (each checked right before),
                                  # then reads again: an experiment, racing
                                  # NVML's own thread, never for a daemon

NVML's BSS is the anonymous mapping right after libnvidia-ml's last
segment in /proc/self/maps.
"""
import ctypes
import os
import struct
import sys
import _ctypes

PAGE = 4096
MADV_DONTNEED = 4
NVML_INIT_FLAG_NO_ATTACH = 2


def status(*keys):
    out = {}
    for line in open('/proc/self/status'):
        k, v = line.split(':', 1)
        if k in keys:
            out[k] = v.strip()
    return out


def step(what):
    print('%-28s %s' % (what, status('VmRSS', 'RssAnon', 'RssFile', 'Threads')), flush=True)


def bss():
    """The anonymous part of libnvidia-ml's last LOAD segment: [start, end)."""
    base, path, start, end, prev = None, None, None, None, ''
    for line in open('/proc/self/maps'):
        f = line.split()
        name = f[5] if len(f) > 5 else ''
        lo, hi = (int(x, 16) for x in f[0].split('-'))
        if 'libnvidia-ml' in name and base is None:
            base, path = lo, name
        if name == '' and f[1] == 'rw-p' and 'libnvidia-ml' in prev:
            start, end = lo, hi
            break
        prev = name
    # The segment's end in memory, from the ELF program headers: the
    # mapping after it may have merged with other anonymous memory.
    with open(path, 'rb') as elf:
        head = elf.read(64)
        phoff, = struct.unpack_from('<Q', head, 32)
        phentsize, phnum = struct.unpack_from('<HH', head, 54)
        elf.seek(phoff)
        table = elf.read(phentsize * phnum)
    seg_end = 0
    for i in range(phnum):
        ptype, _, _, vaddr, _, _, memsz, _ = struct.unpack_from('<IIQQQQQQ', table, i * phentsize)
        if ptype == 1:  # PT_LOAD
            seg_end = max(seg_end, vaddr + memsz)
    return start, min(end, (base + seg_end + PAGE - 1) // PAGE * PAGE)


def rss_of(start):
    cur = None
    for line in open('/proc/self/smaps'):
        f = line.split()
        if '-' in f[0] and len(f) >= 5 and ':' in f[3]:
            cur = int(f[0].split('-')[0], 16)
        elif f[0] == 'Rss:' and cur == start:
            return int(f[1])
    return 0


class Mem(ctypes.Structure):
    _fields_ = [('total', ctypes.c_ulonglong), ('free', ctypes.c_ulonglong), ('used', ctypes.c_ulonglong)]


class Proc(ctypes.Structure):
    _fields_ = [('pid', ctypes.c_uint), ('used', ctypes.c_ulonglong), ('gi', ctypes.c_uint), ('ci', ctypes.c_uint)]


def read(lib):
    """GPU 0's used memory and compute processes, as a collector reads them."""
    h = ctypes.c_void_p()
    ret = lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))
    if ret != 0:
        return 'nvmlDeviceGetHandleByIndex returned %d' % ret
    m = Mem()
    lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m))
    n, procs = ctypes.c_uint(64), (Proc * 64)()
    lib.nvmlDeviceGetComputeRunningProcesses_v3(h, ctypes.byref(n), procs)
    return m.used, sorted((procs[i].pid, procs[i].used) for i in range(n.value))


def main(mode):
    step('start')
    lib = ctypes.CDLL('libnvidia-ml.so.1')
    step('dlopen')
    ret = lib.nvmlInitWithFlags(NVML_INIT_FLAG_NO_ATTACH) if mode == 'noattach' else lib.nvmlInit_v2()
    step('nvmlInit (returned %d)' % ret)
    for tid in sorted(os.listdir('/proc/self/task')):
        task = '/proc/self/task/' + tid
        print('thread %s %s: waits in %s, syscall %s' % (
            tid, open(task + '/comm').read().strip(), open(task + '/wchan').read().strip() or '-',
            open(task + '/syscall').read().split()[0]), flush=True)
    start, end = bss()
    zero = [p for p in range(start, end, PAGE) if ctypes.string_at(p, PAGE) == bytes(PAGE)]
    print('BSS %d KiB, %d KiB resident, %d of %d pages zero' % (
        (end - start) // 1024, rss_of(start), len(zero), (end - start) // PAGE), flush=True)
    print('read:', read(lib), flush=True)
    for _ in range(20):
        read(lib)
    step('21 reads')
    if mode == 'zero-pages':
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        dropped = 0
        for p in range(start, end, PAGE):
            if ctypes.string_at(p, PAGE) == bytes(PAGE):
                libc.madvise(p, PAGE, MADV_DONTNEED)
                dropped += 1
        step('%d zero pages handed back' % dropped)
        print('BSS %d KiB resident' % rss_of(start), flush=True)
        for _ in range(200):
            got = read(lib)
        print('200 reads, the last:', got, flush=True)
        step('after the reads')
        print('BSS %d KiB resident' % rss_of(start), flush=True)
    print('nvmlShutdown', lib.nvmlShutdown())
    step('nvmlShutdown')
    _ctypes.dlclose(lib._handle)
    step('dlclose')


if __name__ == '__main__':
    main(sys.argv[1] if len(sys.argv) > 1 else 'lifecycle')
