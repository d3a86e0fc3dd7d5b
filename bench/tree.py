"""Would tree verification pay here? Measured inputs, one run: the shipped head's rank of the target's
token among its top 4 at the first draft position, its chain's acceptance by depth, the verify cost of
n rows (decode/cost.verify_costs) and the head's cost per draft step. From them, expected tokens per
unit of time of the best chain of k drafts against the best tree of N nodes, for two tree verifiers:

  ideal  one forward of N + 1 rows with a tree mask (a kernel whose attention reads each node's
         ancestors in a contiguous sequence's order: not built)
  slots  each root-to-leaf branch in its own cache slot (no kernel change, exact by construction):
         every branch repeats the root row and the nodes it shares with other branches (built for
         siblings at depth 1: `draft_branches`, decode/loop.py)

    python bench/tree.py [--dtype auto bfloat16] [--max-new-tokens 128] [--head PATH]

Also measured: the verify cost of a chain with 0..3 siblings as the loop runs them (`draft_branches`).

Model of a tree (stated, not measured per node): a node at depth 1 of rank r is accepted with the
measured q_r; below an accepted node, its head-top-1 child with the chain's measured conditional
acceptance c_d, its rank-r child with c_d * q_r / q_1. A tree of N nodes takes the N most likely.
"""
from __future__ import annotations

import argparse
import heapq

import numpy as np
import torch

import exactspec
from exactspec.tools import fetch
from exactspec.decode.cost import fastest, one_row_seconds, verify_costs
from exactspec.decode.head import HeadDrafter
from exactspec.decode.loop import run_batch
from exactspec.model.transformer import Rows
from exactspec.text import chat

from head import MIX

TOP = 4


class Ranking(HeadDrafter):
    """The head, noting its top-4 draft-vocabulary tokens at each step's first draft position."""

    def propose(self, slots, seqs, ks, params):
        self.at, self.first = [len(s) for s in seqs], True
        return super().propose(slots, seqs, ks, params)

    def _step(self, rows, x):
        logits, guess = super()._step(rows, x)
        if self.first:
            for r, n in enumerate(self.at[: len(logits)]):
                self.seen.append((n, self.head.vocab[torch.topk(logits[r], TOP).indices].tolist()))
            self.first = False
        return logits, guess


def measure(target, texts: list[str], max_new: int, path: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(q: P(the target's token is the head's rank r) r = 1..TOP, c: the chain's conditional acceptance
    at depths 1..4 (c[0] = q[0]))."""
    head = Ranking(target.head(path), target.net)
    ranks = np.zeros(TOP + 1)
    for text in texts:
        head.seen = []
        (seq,), _ = run_batch(target.net, [target.request(text, max_new, num_draft_tokens=1)], head)
        full = seq.tokens
        for n, top in head.seen:
            if n < len(full):
                ranks[top.index(full[n]) if full[n] in top else TOP] += 1
    q = ranks[:TOP] / ranks.sum()
    prop, acc = np.zeros(4), np.zeros(4)
    for text in texts:
        st = target.generate(text, max_new, draft=f"head:{path}" if path else "head", num_draft_tokens=4).stats
        prop += np.array((st.proposed_at + [0] * 4)[:4])
        acc += np.array((st.accepted_at + [0] * 4)[:4])
    p = acc / np.maximum(prop, 1)  # P(the first d drafts accepted)
    return q, np.concatenate([[p[0]], p[1:] / np.maximum(p[:-1], 1e-9)])


def best_tree(q: np.ndarray, c: np.ndarray, n: int) -> list[tuple[float, tuple[int, ...]]]:
    """The n most likely nodes: (P(accepted), path of ranks from the root)."""
    out: list[tuple[float, tuple[int, ...]]] = []
    heap = [(-float(q[r]), (r,)) for r in range(TOP)]
    heapq.heapify(heap)
    while heap and len(out) < n:
        v, path = heapq.heappop(heap)
        out.append((-v, path))
        d = len(path)
        if d < len(c):
            for r in range(TOP):
                heapq.heappush(heap, (v * c[d] * q[r] / q[0], path + (r,)))
    return out


def slot_rows(nodes: list[tuple[float, tuple[int, ...]]]) -> int:
    """Rows a slot-per-branch verifier runs: each leaf's path from the root (the root row included)."""
    paths = {p for _, p in nodes}
    leaves = [p for p in paths if not any(o[:len(p)] == p and len(o) > len(p) for o in paths)]
    return sum(len(p) + 1 for p in leaves)


def tree_costs(net, k: int, most: int, at: int = 100) -> list[float]:
    """Measured: a verify of a k-draft chain with j = 0..most siblings (each [last token, sibling] in a
    helper slot forked from the sequence's cache: its partial block copied), over a one-row forward."""
    cache = net.new_cache(1, at + k + 2, helpers=most)
    rows = Rows()
    rows.add(0, list(range(1, at + 1)), 0)
    rows.forward(net, cache)
    out = []
    for j in range(most + 1):
        def verify() -> None:
            tree = Rows()
            tree.add(0, [1] * (k + 1), at, logits_from=0)
            for h in range(1, j + 1):
                cache.fork(0, h, at)
                tree.add(h, [1, 2], at, logits_from=0)
            tree.forward(net, cache)
            for h in range(1, j + 1):
                cache.release(h)
        out.append(fastest(verify, repeat=5) / one_row_seconds(net))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", nargs="+", default=["auto", "bfloat16"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--head", default=None, help="a head folder (default: the shipped one)")
    a = ap.parse_args()
    for dtype in a.dtype:
        target = exactspec.load(fetch.smollm2(), dtype=dtype, max_context=1024)
        texts = [chat.render(target.tokenizer.config, [{"role": "user", "content": m}]) for m in MIX]
        costs = verify_costs(target.net)
        h = target.make_drafter(f"head:{a.head}" if a.head else "head").cost_per_token(target.net)
        q, c = measure(target, texts, a.max_new_tokens, a.head)
        print(f"\nSmolLM2 {dtype}: head rank r=1..{TOP} holds the target's token {np.round(q, 3).tolist()}; "
              f"chain conditional acceptance by depth {np.round(c, 3).tolist()}; head {h:.3f} per draft step")
        print("verify cost of n rows (one-row forwards): " + " ".join(f"{n + 1}:{costs[n]:.2f}" for n in range(12)))
        for k in (1, 2, 4):
            print(f"measured verify of a {k}-draft chain with 0..3 siblings in helper slots: " +
                  " ".join(f"{c:.2f}" for c in tree_costs(target.net, k, 3)))
        print(f"{'N':>2} {'chain tok':>9} {'cost':>5} {'tok/cost':>8} | {'tree tok':>8} {'ideal':>5} {'tok/cost':>8} "
              f"| {'rows':>4} {'slots':>5} {'tok/cost':>8}")
        best = {"chain": 0.0, "ideal": 0.0, "slots": 0.0}
        for n in range(1, 9):
            chain = 1 + np.cumprod(np.concatenate([c, np.full(8, c[-1])]))[:n].sum()
            cc = costs[n] + n * h
            nodes = best_tree(q, c, n)
            tok = 1 + sum(v for v, _ in nodes)
            depth = max(len(p) for _, p in nodes)
            ideal = costs[n] + depth * h
            rows = slot_rows(nodes)
            slots = costs[min(rows - 1, len(costs) - 1)] + depth * h
            print(f"{n:>2} {chain:9.3f} {cc:5.2f} {chain / cc:8.3f} | {tok:8.3f} {ideal:5.2f} {tok / ideal:8.3f} "
                  f"| {rows:>4} {slots:5.2f} {tok / slots:8.3f}")
            best = {"chain": max(best["chain"], chain / cc), "ideal": max(best["ideal"], tok / ideal),
                    "slots": max(best["slots"], tok / slots)}
        print("best tokens per unit of time: " + ", ".join(f"{k} {v:.3f}" for k, v in best.items()) +
              f" (ideal tree vs chain {best['ideal'] / best['chain']:.3f}x, slots {best['slots'] / best['chain']:.3f}x)")


if __name__ == "__main__":
    main()
