#!/usr/bin/env python3
"""What a small write and its fdatasync cost in a file zero-filled by writes of each size.

The page cache keeps a file's pages in folios as large as the writes that made them, and
a small write dirties its whole folio: this shows what that costs, outside oncegate (the
log store zero-fills its segments, docs/benchmarks.md). Usage: folios.py DIR
"""
import os
import resource
import sys
import time


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_stime


def run(chunk, path, writes=6000, record=400):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    zeros = b"\0" * chunk
    before, _ = cpu()
    for mib in range(0, 64 << 20, 1 << 20):
        for offset in range(mib, mib + (1 << 20), chunk):
            os.pwrite(fd, zeros, offset)
        os.fdatasync(fd)
    fill_ms = (cpu()[0] - before) * 1e3
    data = b"x" * record
    _, sys_before = cpu()
    wall = time.time()
    for i in range(writes):
        os.pwrite(fd, data, i * record)
        os.fdatasync(fd)
    wall = time.time() - wall
    sys_us = (cpu()[1] - sys_before) / writes * 1e6
    os.close(fd)
    os.unlink(path)
    print(f"zero-filled by {chunk >> 10:5} KiB writes: fill CPU {fill_ms:6.1f} ms; "
          f"{sys_us:5.1f} us system CPU, {wall / writes * 1e6:4.0f} us wall per small write and fdatasync")


if __name__ == "__main__":
    path = os.path.join(sys.argv[1] if len(sys.argv) > 1 else ".", "folios.test")
    for _ in range(2):
        for chunk in (4 << 10, 16 << 10, 64 << 10, 1 << 20):
            run(chunk, path)
