"""Opening a checkpoint: where it comes from (a local HF folder, a local .gguf file, or a Hugging Face
Hub id (`org/name`, `org/name@revision`, or `org/name/file.gguf`) resolved by `huggingface_hub`
through its cache, which honours HF_HUB_OFFLINE / HF_HUB_CACHE / HF_HOME), and what it holds: config,
packed weights, tokenizer and EOS ids (`open_checkpoint`, which `exactspec.load` wraps in a Model)."""
from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, InvalidRequest, UnsupportedModelError
from ..jsonfile import read_json
from ..kernels.quant import FORMATS, QUANTIZERS
from ..kernels.threads import torch_serial
from ..text.tokenizer import Tokenizer
from .config import ModelConfig, load_config, token_ids
from .gguf_file import GGUFFile
from .memory import release_free_heap
from .pack import DTYPES
from .transformer import Transformer
from .weights import TensorStore

# what a checkpoint folder needs; nothing else of a repo (other weights formats, images) is fetched
PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]
_HUB = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?P<file>/[\w./-]+\.gguf)?(?:@(?P<rev>[\w./-]+))?")


def resolve(source: str | Path) -> Path:
    """A local path to load: the source itself if it exists, else the Hub snapshot (or GGUF file)."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    if path.is_symlink():  # a loop, or a link to nothing: a local path, never a hub id
        try:
            path.resolve(strict=True)
        except RuntimeError:  # pathlib's "Symlink loop" (3.11)
            raise CheckpointError(f"{path}: a symlink loop") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(f"{path}: a symlink loop") from None
        raise CheckpointError(f"{path}: a symlink to {os.readlink(path)!r}, which does not exist")
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


def load_tokenizer(source: str | Path) -> Tokenizer | None:
    """The tokenizer of a folder (tokenizer.json) or GGUF file (its metadata); None if it has none."""
    path = resolve(source)
    if is_gguf(path):
        return GGUFFile(path).tokenizer()
    return Tokenizer.from_folder(path) if (path / "tokenizer.json").is_file() else None


@dataclass
class Checkpoint:
    folder: Path  # the folder or .gguf file it was read from
    cfg: ModelConfig
    net: Transformer
    tokenizer: Tokenizer | None
    eos: tuple[int, ...]


def open_checkpoint(path: str | Path, dtype: str = "auto", max_context: int | None = None,
                    quantize: str | None = None, activations: str = "int8") -> Checkpoint:
    """What `exactspec.load` reads (see its arguments). torch's conversions run on one thread: a model
    is often loaded on a thread that will not run it (a server's main thread; kernels/threads.py)."""
    with torch_serial():
        return _open(path, dtype, max_context, quantize, activations)


def _open(path: str | Path, dtype: str, max_context: int | None, quantize: str | None, activations: str
          ) -> Checkpoint:
    folder = resolve(path)
    gguf = is_gguf(folder)
    if not folder.is_dir() and not gguf:
        raise CheckpointError(f"{folder}: not a directory or a .gguf file (expected a Hugging Face checkpoint "
                              "folder or a GGUF file)")
    if dtype != "auto" and dtype not in DTYPES:
        raise UnsupportedModelError(f"dtype={dtype!r} is not supported (auto, float32, bfloat16)")
    if quantize is not None and quantize not in QUANTIZERS:
        raise UnsupportedModelError(f"quantize={quantize!r} is not supported (None, {', '.join(map(repr, QUANTIZERS))}; "
                                    f"a GGUF file's {', '.join(f.upper() for f in FORMATS)} weights are kept as they are)")
    quant = quantize or ("keep" if dtype == "auto" and gguf else "none")
    dtype = "float32" if dtype == "auto" else dtype
    store = GGUFFile(folder) if gguf else None
    cfg = store.cfg if gguf else load_config(folder)
    if max_context is None:
        max_context = min(cfg.max_position_embeddings, 8192)
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
        raise InvalidRequest(f"max_context={max_context!r}: must be an integer >= 2", "max_context")
    if gguf:
        c = Checkpoint(folder, cfg, Transformer(cfg, store, dtype, max_context, quant, activations), store.tokenizer(),
                       cfg.eos_token_ids)
    else:
        tok = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
        c = Checkpoint(folder, cfg, Transformer(cfg, TensorStore(folder), dtype, max_context, quant, activations), tok,
                       _eos_ids(folder, cfg))
    if c.tokenizer is not None:  # a token id the tokenizer can produce must have an embedding row
        ids = c.tokenizer.tok.get_vocab(with_added_tokens=True).values()
        top = max(ids, default=-1) + 1
        if top > cfg.vocab_size:
            where = folder if gguf else folder / "tokenizer.json"
            raise CheckpointError(f"{where}: the tokenizer has token ids up to {top - 1}, but the model has "
                                  f"{cfg.vocab_size} embedding rows (token_embd / vocab_size)")
    del store  # the GGUF reader's parsed metadata: freed before the heap is handed back
    release_free_heap()
    return c


def _eos_ids(folder: Path, cfg: ModelConfig) -> tuple[int, ...]:
    gen = folder / "generation_config.json"
    if gen.is_file():
        v = read_json(gen).get("eos_token_id")
        if v is not None:
            return token_ids(v, f"{gen}: field 'eos_token_id'")
    return cfg.eos_token_ids
