import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from models import make_checkpoint  # noqa: E402

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


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
