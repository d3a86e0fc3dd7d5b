"""Tiny random checkpoints for the tests and the benches (needs the `hf` extra: transformers),
built with transformers configs and fixed seeds, saved as real HF folders (config.json,
model.safetensors, tokenizer.json, generation_config.json).

Near-tie init (on by default): lm_head rows come in twins that differ only in hidden dim 0, and
the final norm scales dim 0 by 1e-6. Every token's logit then has a twin within ~1e-8, the size
of float32 rounding noise, so any computation whose rounding depends on the row count, the
batch or the thread count flips tokens within a few steps (measured: a model run through
torch's F.linear diverges between plain and speculative decoding). Ours must not.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

VOCAB = 320
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import os\nimport sys\n\nfor path in sys.argv[1:]:\n    print(os.path.getsize(path))\n",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)\n",
]


def make_tokenizer(folder: Path, vocab_size: int = VOCAB) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                              "chat_template": CHAT_TEMPLATE}))


def config_for(arch: str, layers: int = 2, hidden: int = 64, seed_vocab: int = VOCAB, **kw):
    import transformers as tf
    common = dict(vocab_size=seed_vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    common.update(kw)
    if arch == "llama":
        return tf.LlamaConfig(**common), tf.LlamaForCausalLM
    if arch == "llama3":
        c = tf.LlamaConfig(**common, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                          low_freq_factor=1.0, high_freq_factor=4.0,
                                                          original_max_position_embeddings=64))
        return c, tf.LlamaForCausalLM
    if arch == "mistral":
        return tf.MistralConfig(**{**common, "sliding_window": 48}), tf.MistralForCausalLM
    if arch == "qwen2":
        return tf.Qwen2Config(**{**common, "tie_word_embeddings": True}), tf.Qwen2ForCausalLM
    if arch == "qwen3":
        return tf.Qwen3Config(**{**common, "head_dim": 32}), tf.Qwen3ForCausalLM
    if arch == "qwen3moe":  # 8 experts, 3 per token, their weights normalized
        m = {**common, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 64,
             "norm_topk_prob": True}
        m.update(kw)
        return tf.Qwen3MoeConfig(**m), tf.Qwen3MoeForCausalLM
    if arch == "gemma3":  # 5 windowed layers (window 16) then a global one; a head size apart from hidden / heads
        g = {**common, "num_hidden_layers": max(layers, 6), "head_dim": 32, "tie_word_embeddings": True,
             "sliding_window": 16, "query_pre_attn_scalar": 24, "pad_token_id": 0, "hidden_activation": "gelu_pytorch_tanh"}
        g.update(kw)
        return tf.Gemma3TextConfig(**g), tf.Gemma3ForCausalLM
    raise ValueError(arch)


def random_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, near_ties: bool = True,
                 **kw):
    """A transformers model in memory (eval mode), random weights from `seed`, near-tie init by default."""
    cfg, cls = config_for(arch, **kw)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    gemma = arch == "gemma3"  # its norms multiply by (1 + w), and start at w = 0: made random to test that
    if gemma:
        with torch.no_grad():
            for name, w in model.named_parameters():
                if name.endswith("norm.weight"):
                    w.normal_(0.0, 0.2)
    if near_ties:
        with torch.no_grad():
            head = model.get_output_embeddings().weight  # (V, H); tied models share it with the input
            head[1::2, 1:] = head[0::2, 1:]
            model.model.norm.weight[0] = 1e-6 - 1.0 if gemma else 1e-6
    return model.to(dtype)


def q4_k_blocks(n: int, k: int, seed: int, size: int = 144) -> np.ndarray:
    """Random but valid GGUF Q4_K super-blocks of an (n, k) tensor (k % 256 == 0), uint8 (n, k/256*144)
    (size=176: Q5_K's): the gguf package has no K-quant quantizer. d and dmin in [1e-4, 1e-3] keep the
    weights small (but their mean is far from 0: no centring minimum)."""
    rng = np.random.default_rng(seed)
    nb = n * k // 256
    blocks = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    for off in (0, 2):  # d, dmin
        blocks[:, off:off + 2] = rng.uniform(1e-4, 1e-3, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, k // 256 * size)


def q5_k_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Random but valid GGUF Q5_K super-blocks (176 bytes each), as q4_k_blocks."""
    return q4_k_blocks(n, k, seed, 176)


def q6_k_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Random but valid GGUF Q6_K super-blocks of an (n, k) tensor (k % 256 == 0), uint8 (n, k/256*210):
    random quants and int8 scales, d in [1e-4, 1e-3]."""
    rng = np.random.default_rng(seed)
    nb = n * k // 256
    blocks = rng.integers(0, 256, (nb, 210), dtype=np.uint8)
    blocks[:, 208:210] = rng.uniform(1e-4, 1e-3, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, k // 256 * 210)


# Random valid super-blocks of each K-quant, by format (the gguf package quantizes none of them).
K_QUANT_BLOCKS = {"q4_k": q4_k_blocks, "q5_k": q5_k_blocks, "q6_k": q6_k_blocks}


def make_checkpoint(folder: Path, arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
                    tokenizer: bool = True, near_ties: bool = True, **kw) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    random_model(arch, seed, dtype, near_ties, **kw).save_pretrained(folder)
    if tokenizer:
        make_tokenizer(folder)
    return folder


def hf_model(folder: Path, dtype: torch.dtype = torch.float32):
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
