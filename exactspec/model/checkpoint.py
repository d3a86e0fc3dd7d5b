"""Where a model comes from: a local HF folder, a local .gguf file, or a Hugging Face Hub id
(`org/name`, `org/name@revision`, or `org/name/file.gguf`) resolved by `huggingface_hub` through
its cache, which honours HF_HUB_OFFLINE / HF_HUB_CACHE / HF_HOME."""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError

if TYPE_CHECKING:
    from ..text.tokenizer import Tokenizer

# what a checkpoint folder needs; nothing else of a repo (other weights formats, images) is fetched
PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]
_HUB = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?P<file>/[\w./-]+\.gguf)?(?:@(?P<rev>[\w./-]+))?")


def resolve(source: str | Path) -> Path:
    """A local path to load: the source itself if it exists, else the Hub snapshot (or GGUF file)."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    text = str(source)
    m = _HUB.fullmatch(text)
    if m is None or text.startswith((".", "/", "~")):
        raise CheckpointError(f"{path}: no such file or directory (expected a Hugging Face checkpoint folder, a "
                              ".gguf file, or a hub id like org/name)")
    try:
        from huggingface_hub import hf_hub_download, snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError:  # pragma: no cover - a core dependency
        raise CheckpointError(f"{text}: not a local path, and huggingface_hub is not installed") from None
    repo, rev = m["repo"], m["rev"]
    try:
        if m["file"]:
            return Path(hf_hub_download(repo, m["file"][1:], revision=rev))
        return Path(snapshot_download(repo, revision=rev, allow_patterns=PATTERNS))
    except HFValidationError as e:
        raise CheckpointError(f"{text}: not a valid hub id ({e})") from None
    except Exception as e:  # offline without a cached snapshot, unknown repo, gated, network down
        raise CheckpointError(f"{text}: not a local path, and the Hugging Face Hub gave no snapshot "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def load_tokenizer(source: str | Path) -> "Tokenizer | None":
    """The tokenizer of a folder (tokenizer.json) or GGUF file (its metadata); None if it has none."""
    from .gguf_file import GGUFFile
    from ..text.tokenizer import Tokenizer
    path = resolve(source)
    if is_gguf(path):
        return GGUFFile(path).tokenizer()
    return Tokenizer.from_folder(path) if (path / "tokenizer.json").is_file() else None
