"""KV memory of a long Gemma 3 conversation: the sliding-window layers' blocks held against the
global layers', and the process's resident memory, with the window bound (cache.py) and without it
(every position of every layer kept, as before 2026-12-06). Memory only: no timing.

    python window_kv.py [--prompt 4000] [--chunk 16] [FILE]    (default: the Gemma 3 270M file, fetched once)
"""
from __future__ import annotations

import argparse
import sys

import exactspec
from exactspec.decode.loop import Batch
from exactspec.model import cache as C


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", nargs="?", default=None)
    ap.add_argument("--prompt", type=int, default=4000, help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=16, help="prefill chunk (the server's default: 16)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--unbounded", action="store_true", help="keep every local block (the old cache)")
    a = ap.parse_args()
    if a.unbounded:
        C.KVCache._forget = lambda self, s, p: None
    path = a.file
    if path is None:
        from exactspec.tools import fetch
        path = fetch.gemma3()
    m = exactspec.load(path, max_context=a.prompt + a.tokens + 16)
    text = "The quick brown fox jumps over the lazy dog while the river keeps running to the sea. "
    ids = m.encode(text * (a.prompt // 10))[: a.prompt]
    before = rss()
    b = Batch(m.net, 1, a.prompt + a.tokens + 16, None, prefill_chunk=a.chunk)
    b.add(m.request(ids, a.tokens, ignore_eos=True))
    peak = local = 0
    while b.running:
        b.step()
        if b.cache.bytes_used > peak:
            peak, local = b.cache.bytes_used, b.cache.local.used * b.cache.local.block_bytes
    c = b.cache
    print(f"{'unbounded' if a.unbounded else 'window-bounded'}: {len(ids)} prompt + {a.tokens} tokens, chunk {a.chunk}; "
          f"KV in use at peak {peak / 1e6:.1f} MB (sliding layers {local / 1e6:.1f} MB, window "
          f"{c.window}), resident growth {(rss() - before) / 1e6:.1f} MB", file=sys.stdout)


if __name__ == "__main__":
    main()
