"""A model's layers as the compiled forward takes them: `Layer` (one decoder layer's packed weights)
and `Stack` (every layer's weights along a leading layer axis, each linear kind in up to two formats;
a mixture of experts' MLP weights along a leading (layer, expert) axis: layer i's expert e at i * E + e).
pack.py fills them from a checkpoint; forward.py reads them."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ..kernels.pack import PackedWeight, packed_shape
from .memory import ensure_fits


@dataclass
class Layer:
    """One decoder layer's weights (packed). In a loaded model they are views into its `Stack`."""
    attn_norm: np.ndarray  # (H,) float32
    wqkv: PackedWeight  # (Hq*D + 2*Hkv*D, H): q, k, v rows stacked; (Hq*D + Hkv*D, H) when wv is apart
    q_norm: np.ndarray  # (D,) Qwen3, else empty
    k_norm: np.ndarray
    wo: PackedWeight  # (H, Hq*D)
    mlp_norm: np.ndarray
    w_gate: PackedWeight  # (I, H); a mixture of experts: expert 0's (the shape they share), `experts` has them all
    w_up: PackedWeight  # (I, H)
    w_down: PackedWeight  # (H, I)
    wv: PackedWeight | None = None  # (Hkv*D, H): v apart, where a file keeps it in another format than q, k
    post_attn_norm: np.ndarray | None = None  # (H,) Gemma 3: the attention's output normed before the add
    post_mlp_norm: np.ndarray | None = None  # (H,) the MLP's likewise; else empty
    w_router: PackedWeight | None = None  # (E, H) a mixture of experts' router
    experts: list[tuple[PackedWeight, PackedWeight, PackedWeight]] | None = None  # (gate, up, down) of each

    def __post_init__(self) -> None:
        for name in ("post_attn_norm", "post_mlp_norm"):
            if getattr(self, name) is None:
                setattr(self, name, np.empty(0, np.float32))


_NORMS = ("attn_norm", "q_norm", "k_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm")
_LINEARS = ("wqkv", "wv", "wo", "w_gate", "w_down", "w_router")


@dataclass
class Stack:
    """Every layer's weights along a leading layer axis, as `_forward` takes them. Each linear kind
    `name` in up to two formats (a file may keep a kind in one format in some layers and another in
    the rest, as llama.cpp's Q4_K_M): `name` holds the layers of the first, `name_alt` those of the
    second (no layers when there is one), `sel_name` (L,) int64 where layer i is: j >= 0 at name[j],
    j < 0 at name_alt[-1 - j]. Gate and up blocks are interleaved (gate block c at 2c, up block c at
    2c + 1); biases are (L, N) or (L, 0). wv (v apart from q, k) has no layers unless split, w_router none
    unless the model has experts (`experts` > 0: w_gate and w_down then hold L * experts weights)."""
    arrays: dict[str, np.ndarray]
    shapes: dict[str, tuple[int, int]]  # (N, K) of each linear
    work: int  # multiply-adds per row over all layers (the serial/parallel switch)
    experts: int = 0

    @staticmethod
    def empty(like: Layer, layouts: dict[str, tuple[str, ...] | None], n_layers: int, active: int = 1) -> "Stack":
        """Room for `n_layers` layers shaped as `like`, each linear in the layouts of `layouts`
        (pack.Packer.layouts: a layout per layer, or per (layer, expert) for a mixture of experts'),
        checked against the available memory first (a config's layer count is not trusted to size an
        allocation). active: the experts a row runs (the work estimate)."""
        want, shapes, sel = {}, {}, {}  # name -> (shape, dtype)
        for name in _NORMS:
            want[name] = ((n_layers,) + getattr(like, name).shape, np.dtype(np.float32))
        for name in _LINEARS:
            w: PackedWeight | None = getattr(like, name)
            per_layer = layouts[name]
            if w is None:  # no such weight: no layers, of wqkv's type (one compiled tile serves), or the
                w, per_layer = like.wqkv, ()  # router's f32 (a dense and a MoE model of one mix: one compile)
            two = 2 if name == "w_gate" else 1  # gate and up blocks interleaved
            first = per_layer[0] if per_layer else ("f32" if name == "w_router" else w.fmt)
            alt = next((f for f in per_layer if f != first), first)  # the second format, or first again
            n_first = per_layer.count(first)
            for suffix, layout, count in (("", first, n_first), ("_alt", alt, len(per_layer) - n_first)):
                shape, dt = packed_shape(w.n, w.k, layout)
                want[name + suffix] = ((count, two * shape[0]) + shape[1:], dt)
            # layer i: its index among the earlier layers of its format (the alt stack's as -1 - index);
            # linear in the layer count (a config may claim a million layers before the memory check)
            is_first = np.array([f == first for f in per_layer], bool)
            sel[name] = np.where(is_first, np.cumsum(is_first) - 1, -np.cumsum(~is_first))
            want["b_" + name] = ((len(per_layer), w.bias.shape[0] * two), np.dtype(np.float32))
            shapes[name] = (w.n, w.k)
        nbytes = sum(math.prod(shape) * dt.itemsize for shape, dt in want.values())
        ensure_fits(nbytes, f"the weights of {n_layers} layers", "num_hidden_layers")
        a = {name: np.empty(shape, dt) for name, (shape, dt) in want.items()}
        a.update({"sel_" + name: s.astype(np.int64) for name, s in sel.items()})
        n_exp = len(like.experts) if like.experts else 0
        mlp = (2 * math.prod(shapes["w_gate"]) + math.prod(shapes["w_down"])) * (active if n_exp else 1)
        work = sum(math.prod(shapes[n]) for n in ("wqkv", "wv", "wo", "w_router") if a["sel_" + n].shape[0]) + mlp
        return Stack(a, shapes, work * n_layers, n_exp)

    def _at(self, name: str, i: int) -> np.ndarray:
        """Layer i's packed weight `name` (the stack of its format)."""
        j = int(self.arrays["sel_" + name][i])
        return self.arrays[name][j] if j >= 0 else self.arrays[name + "_alt"][-1 - j]

    @functools.cached_property
    def layers(self) -> tuple:
        """The arrays in `_forward`'s order (made once: a forward is the hot path)."""
        a = self.arrays

        def lin(n):
            return (a[n], a[n + "_alt"], a["sel_" + n]), a["b_" + n]
        return (a["attn_norm"], *lin("wqkv"), *lin("wv"), a["q_norm"], a["k_norm"], *lin("wo"), a["mlp_norm"],
                *lin("w_gate"), *lin("w_down"), a["post_attn_norm"], a["post_mlp_norm"], *lin("w_router"))

    def _put(self, name: str, j: int, w: PackedWeight, up: PackedWeight | None = None) -> None:
        # weight j of kind `name` (a layer, or a (layer, expert)); gate with its up, blocks interleaved
        a = self.arrays
        dest = self._at(name, j)
        if up is None:
            dest[...] = w.data
            a["b_" + name][j] = w.bias
        else:
            dest[0::2] = w.data
            dest[1::2] = up.data
            a["b_" + name][j] = np.concatenate([w.bias, up.bias])

    def put(self, i: int, layer: Layer) -> None:
        a = self.arrays
        for name in _NORMS:
            a[name][i] = getattr(layer, name)
        for name in ("wqkv", "wv", "wo", "w_router"):
            w = getattr(layer, name)
            if w is not None:
                self._put(name, i, w)
        E = self.experts
        for e, (g, u, d) in enumerate(layer.experts or [(layer.w_gate, layer.w_up, layer.w_down)]):
            self._put("w_gate", i * E + e if E else i, g, u)
            self._put("w_down", i * E + e if E else i, d)

    def _view(self, name: str, j: int) -> PackedWeight:
        return PackedWeight(self._at(name, j), *self.shapes[name], self.arrays["b_" + name][j])

    def _mlp(self, j: int) -> tuple[PackedWeight, PackedWeight, PackedWeight]:
        n, k = self.shapes["w_gate"]
        gb = self.arrays["b_w_gate"][j]
        half = gb.shape[0] // 2
        gu = self._at("w_gate", j)
        return (PackedWeight(gu[0::2], n, k, gb[:half]), PackedWeight(gu[1::2], n, k, gb[half:]),
                self._view("w_down", j))

    def views(self, i: int) -> Layer:
        a = self.arrays
        lin = {name: self._view(name, i) for name in ("wqkv", "wv", "wo") if a["sel_" + name].shape[0]}
        E = self.experts
        experts = [self._mlp(i * E + e) for e in range(E)] if E else None
        g, u, d = experts[0] if E else self._mlp(i)
        return Layer(**{name: a[name][i] for name in _NORMS}, **lin, w_gate=g, w_up=u, w_down=d,
                     w_router=self._view("w_router", i) if E else None, experts=experts)
