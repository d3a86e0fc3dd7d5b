"""exactspec: speculative decoding whose output is bitwise the same as plain decoding."""
import os as _os

# Vectorized transcendental libraries (SVML) would give exp/silu a different code path in the
# vector body than in the scalar tail of a loop; keep every element on the scalar libm path.
_os.environ.setdefault("NUMBA_DISABLE_INTEL_SVML", "1")
# NUMBA_CPU_NAME=haswell alone compiles for haswell's scheduling with the *host's* features (numba passes
# them to LLVM): on an AVX-512 host the "haswell" build used zmm registers and AVX-512 instructions, so
# code meant to show the AVX2 level (benchmarks, the cross-CPU record) was not. A named CPU means its own
# features unless NUMBA_CPU_FEATURES says otherwise ("" = the name's own, as numba does for "generic").
if _os.environ.get("NUMBA_CPU_NAME", "host") != "host":
    _os.environ.setdefault("NUMBA_CPU_FEATURES", "")
    import sys as _sys
    if "numba" in _sys.modules:  # imported first: its config was read already; it is used at numba's first compile
        from numba.core import config as _config
        if _config.CPU_FEATURES is None:
            _config.CPU_FEATURES = ""


def _numba_cache_dir() -> str:
    # numba's on-disk cache is keyed by the source file of each jitted function only: a change in a
    # module it calls (the IR tile in kernels/tile.py, a kernel helper) would not invalidate it, and a
    # stale kernel would run. Key the cache folder by the content of every module of the package, its
    # subpackages included, instead.
    import hashlib
    here = _os.path.dirname(__file__)
    h = hashlib.sha256()
    for folder, dirs, files in sorted(_os.walk(here)):
        dirs.sort()
        for name in sorted(n for n in files if n.endswith(".py")):
            path = _os.path.join(folder, name)
            with open(path, "rb") as f:
                h.update(_os.path.relpath(path, here).encode() + f.read())
    base = _os.environ.get("XDG_CACHE_HOME") or _os.path.join(_os.path.expanduser("~"), ".cache")
    return _os.path.join(base, "exactspec", "numba", h.hexdigest()[:16])


_os.environ.setdefault("NUMBA_CACHE_DIR", _numba_cache_dir())

from .api import GenerationResult, Model, load  # noqa: E402
from .errors import (CheckpointError, ConstraintError, ContextLengthError, ExactSpecError, GenerationError,  # noqa: E402
                     InvalidArgumentError, InvalidRequest, UnsupportedModelError, WeightError)
from .kernels import set_num_threads  # noqa: E402
from .decode.stats import BatchStats, Stats  # noqa: E402
from .decode.request import Request, make_request  # noqa: E402
from .decode.sampling import SamplingParams  # noqa: E402

__all__ = ["load", "Model", "GenerationResult", "Stats", "BatchStats", "Request", "make_request", "SamplingParams",
           "set_num_threads", "ExactSpecError", "CheckpointError", "WeightError", "UnsupportedModelError",
           "InvalidRequest", "ContextLengthError", "GenerationError", "ConstraintError",
           "InvalidArgumentError"]
