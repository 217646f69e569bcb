"""Where a long `trainwarden run`'s memory goes (issue 45: the launcher's RSS in the hour's soak).

Runs ``trainwarden run ARGS`` in this process with a thread that, every ``$PROBE_EVERY`` seconds (default 60),
appends one line to ``$PROBE_OUT`` (default ./memory-probe.log): the RSS; Python's small-object allocator (pymalloc)
arenas, the bytes in use in them and the bytes free in their pools; and glibc's heap (mallinfo2: bytes it holds from
the system, in use, free). Live Python objects that grow show as pymalloc "used" (or glibc "in use": objects over 512
bytes); memory the allocators keep after the objects went shows as arenas or "free" growing while "used" does not.

    PROBE_OUT=/tmp/mem.log python tests/bench/run_memory_probe.py run --nproc-per-node 4 --job j -- -m \\
        trainwarden.runtime.examples.gpt --tp 2 --pp 2 --batch 8 --micro-batch-size 2 --steps 100000 --ckpt-dir /tmp/c

Ctrl-C ends the run as it would without the probe. glibc only (mallinfo2, glibc 2.33+); with PYTHONMALLOC=malloc the
pymalloc columns read 0.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _pymalloc() -> tuple[int, int, int]:
    """(arenas, bytes used, bytes free in pools) from ``sys._debugmallocstats``, which writes to fd 2."""
    r, w = os.pipe()
    saved = os.dup(2)
    os.dup2(w, 2)
    try:
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    text = b"".join(chunks).decode(errors="replace")

    def number(label: str) -> int:
        m = re.search(rf"# {label}\s*=\s*([\d,]+)", text)
        return int(m.group(1).replace(",", "")) if m else 0

    return number("arenas allocated current"), number("bytes in allocated blocks"), number("bytes in available blocks")


def _probe(out: str, every: float) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    started = time.monotonic()
    while True:
        time.sleep(every)
        m = libc.mallinfo2()
        arenas, used, free = _pymalloc()
        line = (f"{time.monotonic() - started:7.0f} s rss {_rss_mb():7.2f} MB threads {threading.active_count():3d} | "
                f"pymalloc arenas {arenas} used {used / 1e6:.2f} free {free / 1e6:.2f} | glibc held "
                f"{(m.arena + m.hblkhd) / 1e6:.2f} in use {m.uordblks / 1e6:.2f} free {m.fordblks / 1e6:.2f}")
        with open(out, "a") as f:
            f.write(line + "\n")


def main() -> int:
    out = os.environ.get("PROBE_OUT", "memory-probe.log")
    every = float(os.environ.get("PROBE_EVERY", "60"))
    threading.Thread(target=_probe, args=(out, every), daemon=True, name="memory-probe").start()
    from trainwarden.agent.cli.main import main as cli_main
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
