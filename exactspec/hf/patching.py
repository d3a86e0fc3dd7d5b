"""Make a Hugging Face transformers causal LM batch-invariant, on the CPU or on a CUDA GPU.

    model = AutoModelForCausalLM.from_pretrained(path)
    with exactspec.hf.patch(model):                  # or: with exactspec.hf.batch_invariant():
        model.generate(ids, assistant_model=draft)   # == model.generate(ids), token for token

Every floating-point reduction of the model's forward then runs in exactspec's kernels, so the
logits of a position depend on that position's prefix alone (not on how many tokens, rows or
sequences share the forward call, the cache length or the thread count), and greedy, assisted and
prompt-lookup generation give the same tokens.

The kernels are a backend's (backends.py): 'numba' runs exactspec's CPU kernels, 'triton' the Triton
kernels of exactspec.cuda on a CUDA device (chosen by the model's device unless `backend=` says). Below,
the CPU kernels' names; the Triton ones keep the same per-row contract (exactspec/cuda/kernels.py).

How (instance-level: the model's modules are swapped back on exit; the one global step, registering
the "exactspec" and "exactspec_triton" attention functions with transformers' `AttentionInterface`, is
done once and is inert for a model that does not select them):
* each `nn.Linear` -> `kernels.linear` (fixed k order, float32 accumulation, result cast back to the
  weight's dtype as torch's bf16 matmul does); packed weights are made on first use and kept while
  the patch is on (memory: one extra copy of the weights);
* each `*RMSNorm` -> `kernels.rmsnorm` (per row, sum of squares in index order), then the weight
  multiply in torch as transformers does it;
* each SwiGLU MLP -> gate and up in one `kernels.linear` call, `kernels.silu_mul` per row (one
  scalar exp per element: no vector body / tail split), down; intermediates stay float32;
* the rotary embedding -> a cos/sin table computed per position by scalar libm (an entry never
  depends on how many positions a call asks for);
* attention -> `hf.attention.masked_attention`, registered with transformers' `AttentionInterface` as
  "exactspec" and selected through `config._attn_implementation`; its mask function always
  materializes the boolean mask, so padding and sliding windows are honoured key by key.
Elementwise adds and multiplies (residuals, rotary mix) stay in torch: they are correctly rounded.

Why modules and not aten overrides (torch.library on mm/addmm/bmm/_softmax/mean/sdpa): an aten
override cannot reach the other row-count-dependent steps (vectorized rsqrt/exp/cos/sin with a
scalar tail, the rotary table computed from a call-length arange), would change every torch user
in the process, and would have to guess a model's masking from sdpa's arguments. Replacing the
few module types of known architectures covers every step, is checked module by module (an
unknown module type is an error), and is undone by deleting instance attributes.

Covered: transformers >= 5.0, < 6; model types llama, mistral, qwen2, qwen3; rope types default,
linear, llama3; float32 or bfloat16 parameters on the CPU, float32, bfloat16 or float16 on CUDA;
inference only (under torch.no_grad()).
Anything else raises UnsupportedModelError or InvalidRequest before anything is changed.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from .. import kernels
from ..errors import InvalidRequest, UnsupportedModelError
from . import backends
from .interface import register

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
TRANSFORMERS_RANGE = ((5, 0), (6, 0))  # [low, high)
_NORM_CLASSES = tuple(f"{p}RMSNorm" for p in ("Llama", "Mistral", "Qwen2", "Qwen3"))
_ROTARY_CLASSES = tuple(f"{p}RotaryEmbedding" for p in ("Llama", "Mistral", "Qwen2", "Qwen3"))
_MLP_CLASSES = tuple(f"{p}MLP" for p in ("Llama", "Mistral", "Qwen2", "Qwen3"))
_CONTAINERS = tuple(f"{p}{s}" for p in ("Llama", "Mistral", "Qwen2", "Qwen3")
                    for s in ("ForCausalLM", "Model", "DecoderLayer", "Attention"))


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise UnsupportedModelError("exactspec.hf needs transformers: pip install 'exactspec[hf]'") from e
    return transformers


def transformers_version() -> str:
    return _transformers().__version__


def check_transformers_version(version: str | None = None) -> None:
    """Raise UnsupportedModelError unless transformers' version is in TRANSFORMERS_RANGE."""
    version = version or transformers_version()
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        raise UnsupportedModelError(f"transformers version {version!r} cannot be parsed") from None
    low, high = TRANSFORMERS_RANGE
    if not low <= major_minor < high:
        raise UnsupportedModelError(
            f"exactspec.hf supports transformers >= {low[0]}.{low[1]}, < {high[0]}.{high[1]}; "
            f"installed: {version}. Install a supported version (pip install 'transformers>=5,<6').")


# ---------------------------------------------------------------------------------------------
# Replacement forwards, installed as each module's instance `forward`.
# ---------------------------------------------------------------------------------------------

def _check_input(x: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> None:
    """`dtype`: the dtype the input must have (a linear's weight dtype, as torch requires)."""
    if dtype is not None and x.dtype != dtype:
        raise InvalidRequest(f"{name}: input dtype {x.dtype} does not match weight dtype {dtype}")
    if x.requires_grad and torch.is_grad_enabled():
        raise InvalidRequest(f"{name}: exactspec.hf is inference-only (no autograd through its kernels); "
                                   "run the model under torch.no_grad() or torch.inference_mode()")


class _Packed:
    """Packed weights of one or more nn.Linear (concatenated along outputs), re-packed whenever a
    weight or bias is replaced or changed in place."""

    def __init__(self, ops, *linears: nn.Linear):
        self.ops, self.linears = ops, linears
        self.key: tuple = ()
        self.packed = None

    def get(self):
        key = tuple((id(t), t.data_ptr(), t._version) for m in self.linears for t in (m.weight, m.bias)
                    if t is not None)
        if key != self.key:
            with torch.no_grad():
                w = torch.cat([m.weight.detach() for m in self.linears])
                bias = None
                if any(m.bias is not None for m in self.linears):
                    bias = torch.cat([m.bias.detach().float() if m.bias is not None
                                      else torch.zeros(m.out_features, device=w.device) for m in self.linears])
                self.packed = self.ops.pack(w, bias)
            self.key = key
        return self.packed


class _Linears:
    """nn.Linear.forward through the backend's linear, the result in the weight's dtype as torch's.

    Linears that take the same input (an attention module's q, k and v projections) are grouped:
    the first call with an input tensor computes all their outputs in one kernel call, and the
    others' calls with that same tensor take their share. A column's bits are the same either way
    (each output is its own k-ordered sum), so grouping only saves calls."""

    def __init__(self, ops, modules: list[nn.Linear], names: list[str]):
        self.ops, self.modules, self.names = ops, modules, names
        self.weights = _Packed(ops, *modules)
        self.bounds = np.cumsum([0] + [m.out_features for m in modules]).tolist()
        self.pending: tuple | None = None  # (input, its version, thread, outputs, indices not yet taken)

    def forward(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return functools.partial(self.__call__, i)

    def __call__(self, i: int, x: torch.Tensor) -> torch.Tensor:
        dtype = self.modules[i].weight.dtype
        p = self.pending
        if p is not None and p[0] is x and p[1] == x._version and p[2] == threading.get_ident() and i in p[4]:
            y = p[3]
            p[4].discard(i)
            if not p[4]:
                self.pending = None
        else:
            _check_input(x, self.names[i], dtype)
            y = self.ops.linear(x, self.weights.get(), self.names[i], dtype)
            rest = set(range(len(self.modules))) - {i}
            self.pending = (x, x._version, threading.get_ident(), y, rest) if rest else None
        lo, hi = self.bounds[i], self.bounds[i + 1]
        part = y if len(self.modules) == 1 else y[:, lo:hi]
        return part.reshape(*x.shape[:-1], hi - lo)


class _MLP:
    """The SwiGLU MLP, down(silu(gate(x)) * up(x)), as two linear kernel calls: gate and up packed
    together, silu * up per row, down (the intermediate as the backend keeps it: float32 on the CPU,
    closer to float64 than transformers' rounding to the model dtype, and as invariant)."""

    def __init__(self, ops, module: nn.Module, name: str):
        self.ops, self.name, self.down_proj = ops, name, module.down_proj
        self.gate_up, self.down = _Packed(ops, module.gate_proj, module.up_proj), _Packed(ops, module.down_proj)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.down_proj.weight.dtype
        _check_input(x, self.name, dtype)
        y = self.ops.mlp(x, self.gate_up.get(), self.down.get(), self.name, dtype)
        return y.view(*x.shape[:-1], y.shape[1])


class _RMSNorm:
    """transformers: w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype). The kernel computes the
    normalized row in x's dtype; the weight multiply stays as transformers does it."""

    def __init__(self, ops, module: nn.Module, name: str):
        self.ops, self.module, self.name = ops, module, name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.name)
        return self.module.weight * self.ops.rmsnorm(x, self.module.variance_epsilon, self.name).view(x.shape)


class _Rotary:
    """Rotary cos/sin from a per-position table (scalar libm per entry, on the CPU), grown as
    positions demand, copied to the model's device."""

    def __init__(self, ops, module: nn.Module, name: str):
        self.module = module
        self.key: tuple | None = None
        self.cos = self.sin = torch.empty(0)

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.module.inv_freq
        need = int(position_ids.max()) + 1 if position_ids.numel() else 1
        key = (inv.data_ptr(), inv._version)
        if key != self.key or need > self.cos.shape[0]:
            n = max(need, 2 * self.cos.shape[0] if key == self.key else 256)
            cos, sin = kernels.rope_table(inv.detach().float().cpu(), n)
            self.cos, self.sin = cos.to(inv.device), sin.to(inv.device)
            self.key = key
        scale = self.module.attention_scaling
        cos, sin = self.cos[position_ids], self.sin[position_ids]
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(x.dtype), sin.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Patching one model
# ---------------------------------------------------------------------------------------------

def _backend_for(model: nn.Module, backend: str | None) -> str:
    """`backend` as given, else 'triton' for a model on a CUDA device and 'numba' otherwise."""
    if backend is not None:
        return backend
    first = next(iter(model.parameters()), None)
    return "triton" if first is not None and first.device.type == "cuda" else "numba"


def _check(model: nn.Module, ops) -> list[tuple[str, nn.Module, str]]:
    """Validate everything first; return (name, module, kind) for the modules to override."""
    check_transformers_version()
    config = getattr(model, "config", None)
    mtype = getattr(config, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"exactspec.hf: model type {mtype!r} ({type(model).__name__}) is not supported; "
                                    f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    devices = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        ops.check_device(t.device, name)
        devices.add(t.device)
        if t.is_floating_point() and t.dtype not in ops.dtypes:
            raise UnsupportedModelError(f"exactspec.hf: {name} is {t.dtype}; backend {ops.name!r} supports "
                                        + " or ".join(str(d).removeprefix("torch.") for d in ops.dtypes))
    if len(devices) > 1:
        raise InvalidRequest(f"exactspec.hf: the model is spread over {sorted(map(str, devices))}; one device only")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"exactspec.hf: hidden_act {config.hidden_act!r}; only 'silu' is supported")
    kinds = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if isinstance(m, nn.Linear):
            kinds.append((name, m, "linear"))
        elif cls in _NORM_CLASSES:
            kinds.append((name, m, "norm"))
        elif cls in _ROTARY_CLASSES:
            rope = getattr(m, "rope_type", "default")
            if rope not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(f"exactspec.hf: rope type {rope!r} at {name}; supported: "
                                            f"{', '.join(SUPPORTED_ROPE_TYPES)}")
            kinds.append((name, m, "rotary"))
        elif cls in _MLP_CLASSES:
            kinds.append((name, m, "mlp"))
        elif name.endswith("mlp.act_fn") and cls == "SiLUActivation":
            pass  # the patched MLP computes silu itself
        elif isinstance(m, (nn.Embedding, nn.Dropout, nn.Identity, nn.ModuleList)) or cls in _CONTAINERS:
            pass
        else:
            raise UnsupportedModelError(f"exactspec.hf: module {name or '<root>'} ({cls}) is not one exactspec "
                                        "knows how to make batch-invariant")
    return kinds


def _linear_groups(linears: dict[str, nn.Linear]) -> list[list[str]]:
    """Names of linears to run as one call: each attention module's q/k/v (same input, same dtype);
    every other linear alone."""
    groups, taken = [], set()
    for name in linears:
        if name.endswith(".q_proj"):
            trio = [name, name[:-6] + "k_proj", name[:-6] + "v_proj"]
            if all(n in linears for n in trio) and len({linears[n].weight.dtype for n in trio}) == 1:
                groups.append(trio)
                taken.update(trio)
    return groups + [[n] for n in linears if n not in taken]


class Patch:
    """The installation on one model: replacement forwards in place, and what to restore."""

    def __init__(self, model: nn.Module, backend: str):
        ops = backends.ops(backend)
        kinds = _check(model, ops)  # raises before anything is changed
        register()
        make = {"mlp": _MLP, "norm": _RMSNorm, "rotary": _Rotary}
        forwards = [(m, make[kind](ops, m, name)) for name, m, kind in kinds if kind != "linear"]
        linears = {name: m for name, m, kind in kinds if kind == "linear"}
        for group in _linear_groups(linears):
            shared = _Linears(ops, [linears[n] for n in group], group)
            forwards += [(linears[n], shared.forward(i)) for i, n in enumerate(group)]
        self.model, self.backend = model, backend
        self.saved = [(m, m.__dict__.get("forward")) for m, _ in forwards]
        for m, fwd in forwards:
            m.__dict__["forward"] = fwd  # an instance attribute: shadows the class's forward
        self.attn = model.config._attn_implementation
        model.config._attn_implementation = ops.attn_name

    def restore(self) -> None:
        for m, old in self.saved:
            if old is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = old
        self.model.config._attn_implementation = self.attn


_lock = threading.RLock()
_installed: dict[int, list] = {}  # id(model) -> [Patch, handle count]


class Handle:
    """What `patch` returns: undo it (or leave its `with` block) to release this hold on the patch."""

    def __init__(self, model: nn.Module, backend: str | None = None):
        backend = _backend_for(model, backend)
        with _lock:
            entry = _installed.get(id(model))
            if entry is None:
                entry = _installed[id(model)] = [Patch(model, backend), 0]
            elif entry[0].backend != backend:
                raise InvalidRequest(f"exactspec.hf: the model is already patched with backend {entry[0].backend!r}, "
                                     f"not {backend!r}")
            entry[1] += 1
        self.model = model
        self.active = True

    def undo(self) -> None:
        with _lock:
            if not self.active:
                return
            self.active = False
            entry = _installed[id(self.model)]
            entry[1] -= 1
            if entry[1] == 0:
                del _installed[id(self.model)]
                entry[0].restore()

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def patch(model: nn.Module, backend: str | None = None) -> Handle:
    """Make `model` batch-invariant until the returned handle is undone (or its `with` block ends).
    backend: 'numba' (exactspec's CPU kernels) or 'triton' (exactspec.cuda's); by default 'triton' for
    a model on a CUDA device, 'numba' otherwise."""
    return Handle(model, backend)


def is_patched(model: nn.Module) -> bool:
    return id(model) in _installed


@contextlib.contextmanager
def batch_invariant(*models: nn.Module, backend: str | None = None) -> Iterator[None]:
    """Inside the block, the given models - or, given none, every transformers model called in this
    process - run batch-invariant (backend: as `patch`'s). A model of an unsupported kind raises when
    it is called."""
    if models:
        handles = []
        try:
            for m in models:
                handles.append(patch(m, backend))
            yield
        finally:
            for h in reversed(handles):
                h.undo()
        return
    from transformers import PreTrainedModel
    handles: list[Handle] = []
    covered: set[int] = set()  # ids of patched models and their submodules (a base model runs inside)
    had = "__call__" in PreTrainedModel.__dict__
    previous = PreTrainedModel.__call__

    def call(self, *args, **kwargs):
        with _lock:
            if id(self) not in covered and not is_patched(self):
                handles.append(patch(self, backend))
                covered.update(id(m) for m in self.modules())
        return previous(self, *args, **kwargs)

    PreTrainedModel.__call__ = call
    try:
        yield
    finally:
        if had:
            PreTrainedModel.__call__ = previous
        else:
            del PreTrainedModel.__call__
        for h in reversed(handles):
            h.undo()
