"""exactspec: speculative decoding whose output is bitwise the same as plain decoding."""
import os as _os

# Vectorized transcendental libraries (SVML) would give exp/silu a different code path in the
# vector body than in the scalar tail of a loop; keep every element on the scalar libm path.
_os.environ.setdefault("NUMBA_DISABLE_INTEL_SVML", "1")

from .api import GenerationResult, Model, load  # noqa: E402
from .decode import Stats  # noqa: E402
from .errors import (CheckpointError, ContextLengthError, ExactSpecError, InvalidArgumentError,  # noqa: E402
                     UnsupportedModelError, WeightError)
from .kernels import set_num_threads  # noqa: E402

__all__ = ["load", "Model", "GenerationResult", "Stats", "set_num_threads", "ExactSpecError", "CheckpointError",
           "WeightError", "UnsupportedModelError", "ContextLengthError", "InvalidArgumentError"]
