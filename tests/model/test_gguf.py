"""GGUF files: a tiny model written with gguf.GGUFWriter (float32, BF16, Q8_0) loads through
exactspec.load and computes what the same weights compute from a HF folder / transformers."""
from __future__ import annotations

import math
import zlib

import gguf
import numpy as np
import pytest
import torch

import exactspec
from exactspec.errors import CheckpointError, UnsupportedModelError, WeightError
from exactspec.model.gguf_file import GGUFFile
from exactspec.tools.testing import K_QUANT_BLOCKS, random_model


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:  # as llama.cpp's converter stores llama q/k rows
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tokenizer(w: gguf.GGUFWriter, folder) -> None:
    """The test folder's byte-level BPE tokenizer.json as `tokenizer.ggml.*` metadata, as llama.cpp's
    converter writes it (tokens by id, control types for the added tokens, merges, chat template)."""
    import json
    j = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**j["model"]["vocab"], **{t["content"]: t["id"] for t in j["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in j["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]])
    w.add_bos_token_id(vocab["<s>"])
    w.add_add_bos_token(False)
    w.add_chat_template(json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])


def converter_rope_freqs(c) -> torch.Tensor:
    """Llama 3.x's rope_freqs tensor as llama.cpp's convert_hf_to_gguf.py computes it (its loop over the
    frequencies in float32 torch arithmetic, restated here): the divisor of each RoPE frequency."""
    s, dim = c.rope_parameters, c.hidden_size // c.num_attention_heads
    freqs = 1.0 / (s["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    ctx, low, high, factor = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"], \
        s["factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < ctx / high:
            out.append(1)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def write_gguf(model, path, qtype=gguf.GGMLQuantizationType.F32, arch="llama", skip=(), tokenizer_folder=None,
               embed_type=None, types=None):
    """types: {GGUF tensor name without its "blk.N." prefix: type} overriding qtype (mixed files). A Llama 3.x
    model (rope_type llama3) gets llama.cpp's rope_freqs tensor, as its converter writes it."""
    c = model.config
    sd = {k: v.float() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    gemma = arch == "gemma3"
    w.add_rope_freq_base(c.rope_parameters["full_attention" if gemma else "rope_theta"]["rope_theta"] if gemma else
                         c.rope_parameters["rope_theta"])
    if getattr(c, "head_dim", None):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if gemma:  # as llama.cpp's converter: the window; the pattern (every 6th layer global) and local base are defaults
        w.add_sliding_window(c.sliding_window)
    moe = arch == "qwen3moe"
    if moe:  # as llama.cpp's converter: the experts' count, how many a token takes, their size
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(1)
    if tokenizer_folder is not None:
        add_tokenizer(w, tokenizer_folder)

    def put(name, t, qtype=qtype):
        if name in skip:
            return
        if gemma and name.endswith("norm.weight"):  # the converter stores Gemma's norms as 1 + w
            t = t + 1.0
        types_ = types or {}  # a layer's own name ("blk.1.attn_v.weight") first, then the kind's
        qtype = types_.get(name, types_.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, qtype))
        a = t.numpy()
        if a.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, np.ascontiguousarray(a, np.float32))
        elif qtype == gguf.GGMLQuantizationType.BF16:
            bits = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(name, bits, raw_dtype=qtype)
        elif qtype.name.lower() in K_QUANT_BLOCKS:  # no quantizer in the gguf package: random blocks
            blocks = K_QUANT_BLOCKS[qtype.name.lower()](a.size // a.shape[-1], a.shape[-1], seed=zlib.crc32(name.encode()))
            w.add_tensor(name, blocks.reshape(a.shape[:-1] + (-1,)), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    if (c.rope_parameters or {}).get("rope_type") == "llama3":
        put("rope_freqs.weight", converter_rope_freqs(c))
    put("token_embd.weight", sd["model.embed_tokens.weight"], embed_type or qtype)
    put("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _permute(q, c.num_attention_heads), _permute(k, c.num_key_value_heads)
        norms = ((("ffn_norm.weight", sd[p + "pre_feedforward_layernorm.weight"]),
                  ("post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"]),
                  ("post_ffw_norm.weight", sd[p + "post_feedforward_layernorm.weight"])) if gemma else
                 (("ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]),))
        for hf, g in (("q_norm.weight", "attn_q_norm.weight"), ("k_norm.weight", "attn_k_norm.weight")):
            if p + "self_attn." + hf in sd:
                norms += ((g, sd[p + "self_attn." + hf]),)
        if moe:  # each kind's experts as one (E, N, K) tensor (transformers 5 holds gate and up fused), the router
            gate, up = sd[p + "mlp.experts.gate_up_proj"].chunk(2, dim=1)
            mlp = (("ffn_gate_exps.weight", gate), ("ffn_up_exps.weight", up),
                   ("ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"]),
                   ("ffn_gate_inp.weight", sd[p + "mlp.gate.weight"]))
        else:
            mlp = (("ffn_gate.weight", sd[p + "mlp.gate_proj.weight"]), ("ffn_up.weight", sd[p + "mlp.up_proj.weight"]),
                   ("ffn_down.weight", sd[p + "mlp.down_proj.weight"]))
        for name, t in (("attn_norm.weight", sd[p + "input_layernorm.weight"]), ("attn_q.weight", q),
                        ("attn_k.weight", k), ("attn_v.weight", sd[p + "self_attn.v_proj.weight"]),
                        ("attn_output.weight", sd[p + "self_attn.o_proj.weight"]), *norms, *mlp):
            put(b + name, t)
        for hf, g in (("q_proj.bias", "attn_q.bias"), ("k_proj.bias", "attn_k.bias"), ("v_proj.bias", "attn_v.bias")):
            if p + "self_attn." + hf in sd:
                put(b + g, sd[p + "self_attn." + hf])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _ids(n=40):
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3", "gemma3", "qwen3moe"])
def test_float32_gguf_equals_the_hf_folder_bitwise(ckpt, arch, tmp_path):
    """The same float32 weights from a GGUF file (llama: q/k rows permuted as llama.cpp stores them; Llama
    3.x: its RoPE scaling as the rope_freqs tensor; Gemma 3: norms stored as 1 + w, windows and local RoPE
    base by llama.cpp's defaults) and from the HF folder: bitwise the same logits, close to transformers."""
    kw = {"query_pre_attn_scalar": 32} if arch == "gemma3" else {}  # llama.cpp scales by 1/sqrt(head size)
    folder = ckpt(arch, **kw)
    hf = random_model(arch, **kw)  # the same seed and init as the folder
    path = write_gguf(hf, tmp_path / "m.gguf", arch="llama" if arch == "llama3" else arch)
    if arch == "llama3":  # the file really carries the scaling, and it really scales
        f = GGUFFile(path).cfg.rope_scaling["freq_factors"]
        assert len(set(f)) == 3 and max(f) == 8.0  # 1, a blended factor, 8
        assert not torch.equal(exactspec.load(path).logits(_ids()), exactspec.load(ckpt("llama")).logits(_ids()))
    a, b = exactspec.load(path), exactspec.load(folder)
    assert a.cfg.tie_word_embeddings == b.cfg.tie_word_embeddings and a.cfg.qkv_bias == b.cfg.qkv_bias
    ids = _ids()
    assert torch.equal(a.logits(ids), b.logits(ids))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert (a.logits(ids) - want).abs().max() < 1e-4


@pytest.mark.parametrize("qtype", [getattr(gguf.GGMLQuantizationType, q) for q in ("F16", "BF16", "Q8_0", "Q5_0", "Q4_1", "Q4_0")])
def test_quantized_gguf_is_dequantized_by_the_gguf_package(tmp_path, qtype):
    hf = random_model("llama", hidden=64)
    path = write_gguf(hf, tmp_path / "m.gguf", qtype)
    m = exactspec.load(path, dtype="bfloat16")
    f = exactspec.model.gguf_file.GGUFFile(path)
    t = f.tensors["blk.0.ffn_up.weight"]
    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).to(torch.bfloat16).float()
    assert torch.equal(m.net.layers[0].w_up.unpack(), want)
    ids = _ids()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    bound = 0.25 if qtype.name.startswith("Q4") else 0.1  # 4-bit rounding on random weights: ~0.15 of the max
    assert (m.logits(ids) - ref).abs().max() < bound * ref.abs().max()  # quantization error, not a layout bug
    g = m.generate(ids, 24, ignore_eos=True)
    assert m.generate(ids, 24, ignore_eos=True, draft="lookup", num_draft_tokens=3).token_ids == g.token_ids


def test_bad_gguf_files_are_named_errors(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTAGGUF" + bytes(100))
    with pytest.raises(CheckpointError, match="bad.gguf: not a readable GGUF file"):
        exactspec.load(bad)
    hf = random_model("llama", hidden=64)
    whole = write_gguf(hf, tmp_path / "whole.gguf").read_bytes()
    for n in (40, len(whole) // 2, len(whole) - 64):  # header, tensor data, the last tensor cut short
        (tmp_path / "cut.gguf").write_bytes(whole[:n])
        with pytest.raises(CheckpointError, match="cut.gguf: not a readable GGUF file"):
            exactspec.load(tmp_path / "cut.gguf")
    with pytest.raises(WeightError, match=r"'blk\.1\.ffn_up\.weight' \(model\.layers\.1\.mlp\.up_proj\.weight\) is missing"):
        exactspec.load(write_gguf(hf, tmp_path / "missing.gguf", skip=("blk.1.ffn_up.weight",)))
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2'"):
        exactspec.load(tmp_path / "gpt2.gguf")


def _patch_field(path, key: str, fmt: str, value, skip: int = 4) -> None:
    """Overwrite the value of metadata `key` in place: after the key, `skip` bytes (its type; an
    array's type and element type: 8), then `value` packed as `fmt`."""
    import struct
    raw = bytearray(path.read_bytes())
    at = raw.index(key.encode()) + len(key) + skip
    struct.pack_into(fmt, raw, at, value)
    path.write_bytes(bytes(raw))


def test_hostile_gguf_counts_are_named_before_anything_is_allocated(tmp_path, capsys):
    """Issue 27: an array count of 2**61 (the gguf reader trusted it: minutes, gigabytes), a block
    count of 10**6 (a 2 TiB allocation), 0 heads (ZeroDivisionError): each a one-line error naming
    the field, at once."""
    from exactspec.cli import main
    hf = random_model("llama", hidden=64)
    w = gguf.GGUFWriter(str(tmp_path / "arr.gguf"), "llama")
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _patch_field(tmp_path / "arr.gguf", "tokenizer.ggml.token_type", "<Q", 2 ** 61, skip=8)
    with pytest.raises(CheckpointError, match=r"'tokenizer\.ggml\.token_type' claims 2305843009213693952 entries"):
        exactspec.load(tmp_path / "arr.gguf")
    assert main(["generate", "--model", str(tmp_path / "arr.gguf"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "token_type" in err and len(err.splitlines()) == 1, err
    for key, value, needle in (("llama.block_count", 10 ** 6, r"'llama\.block_count' is 1000000, the file has "
                                                              r"tensors of 2 layers"),
                               ("llama.attention.head_count", 0, r"'llama\.attention\.head_count' is 0, expected an "
                                                                 r"integer >= 1")):
        path = write_gguf(hf, tmp_path / f"{key}.gguf")
        _patch_field(path, key, "<I", value)
        with pytest.raises(CheckpointError, match=needle):
            exactspec.load(path)


@pytest.mark.parametrize("case,needle", [
    ("type", r"tensor 'blk\.0\.ffn_down\.weight': unknown type 99"),
    ("rows", r"tensor 'blk\.0\.ffn_down\.weight': rows of 176 values are not whole Q4_0 blocks of 32"),
    ("truncated", r"tensor 'blk\.1\.ffn_down\.weight': its 6912 bytes at data offset \d+ run past the end of "
                  r"the file")])
def test_bad_tensors_are_named(tmp_path, case, needle):
    """Issue 24: a tensor of an unknown type, rows that are not whole blocks, a file cut inside the
    tensor data: each a CheckpointError naming the tensor (the gguf reader said "cannot reshape")."""
    import struct
    path = write_gguf(random_model("llama", hidden=64), tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q4_0)
    raw = bytearray(path.read_bytes())
    key = b"blk.0.ffn_down.weight"
    at = raw.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)  # its n_dims, dims, type, offset
    if case == "type":
        struct.pack_into("<I", raw, at + 4 + 16, 99)
    elif case == "rows":
        struct.pack_into("<Q", raw, at + 4, 176)
    else:
        raw = raw[:-1000]
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=needle):
        exactspec.load(path)


def test_a_config_with_a_million_layers_is_refused_before_allocating(ckpt, tmp_path):
    import json
    import shutil
    folder = shutil.copytree(ckpt("llama"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 10 ** 6
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(exactspec.InvalidRequest, match="the weights of 1000000 layers needs .* GB available"):
        exactspec.load(folder)


def _tensor_info(raw: bytearray, name: str) -> int:
    """Where tensor `name`'s info continues after its name (n_dims, dims, type, offset)."""
    import struct
    key = name.encode()
    return raw.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)


@pytest.mark.parametrize("case,exc,needle", [
    ("nan weight", WeightError, r"m.gguf: tensor 'blk\.0\.ffn_up\.weight' holds 1 NaN or infinite values"),
    ("inf norm", WeightError, r"m.gguf: tensor 'blk\.1\.attn_norm\.weight' holds 1 NaN or infinite values"),
    ("inf q8_0 scale", WeightError, r"m.gguf: tensor 'blk\.0\.attn_q\.weight' holds \d+ NaN or infinite values"),
    ("nan rope base", CheckpointError, r"m.gguf: llama\.rope\.freq_base is nan; expected a finite number > 0"),
    ("negative eps", CheckpointError, r"m.gguf: llama\.attention\.layer_norm_rms_epsilon is -1\.0; expected a finite"),
    ("kv heads", CheckpointError, r"m.gguf: llama\.attention\.head_count_kv is 3; the 4 query heads "
                                  r"\(llama\.attention\.head_count\) must be a whole multiple of it"),
    ("misaligned", CheckpointError, r"tensor 'blk\.0\.attn_norm\.weight': data offset \d+ is not a multiple of "
                                    r"general\.alignment \(32\)"),
])
def test_impossible_numbers_are_named_at_load(tmp_path, case, exc, needle):
    """Issue 40: NaN weights (greedy gave [0, 0, 0, 0]), an Inf norm weight or Q8_0 scale, a NaN RoPE base,
    a negative epsilon, KV heads that do not divide the heads, a misaligned tensor: loaded silently
    before; each a named error at load now."""
    import struct
    hf = random_model("llama", hidden=64)
    types = {"attn_q.weight": gguf.GGMLQuantizationType.Q8_0}
    if case == "nan weight":
        with torch.no_grad():
            hf.model.layers[0].mlp.up_proj.weight[3, 5] = float("nan")
    if case == "inf norm":
        with torch.no_grad():
            hf.model.layers[1].input_layernorm.weight[7] = float("inf")
    path = write_gguf(hf, tmp_path / "m.gguf", types=types)
    raw = bytearray(path.read_bytes())
    if case == "inf q8_0 scale":  # the first block's float16 scale of blk.0.attn_q: +Inf
        info = _tensor_info(raw, "blk.0.attn_q.weight")
        offset = struct.unpack_from("<Q", raw, info + 4 + 16 + 4)[0]
        end = max(_tensor_info(raw, t.name) for t in gguf.GGUFReader(str(path)).tensors)
        start = -(-(end + 4 + 16 + 4 + 8) // 32) * 32  # the data section: after the last info, aligned
        struct.pack_into("<H", raw, start + offset, 0x7C00)
    elif case == "misaligned":
        info = _tensor_info(raw, "blk.0.attn_norm.weight")  # 1 dim: n_dims, dim, type, offset
        offset = struct.unpack_from("<Q", raw, info + 4 + 8 + 4)[0]
        struct.pack_into("<Q", raw, info + 4 + 8 + 4, offset + 4)
    path.write_bytes(bytes(raw))
    if case == "nan rope base":
        _patch_field(path, "llama.rope.freq_base", "<f", float("nan"))
    elif case == "negative eps":
        _patch_field(path, "llama.attention.layer_norm_rms_epsilon", "<f", -1.0)
    elif case == "kv heads":
        _patch_field(path, "llama.attention.head_count_kv", "<I", 3)
    with pytest.raises(exc, match=needle):
        exactspec.load(path)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path, ckpt):
    """Issue 40: 49652 tokens over 49152 embedding rows loaded; a token past the rows has no embedding."""
    folder = ckpt("llama")
    hf = random_model("llama")
    path = write_gguf(hf, tmp_path / "m.gguf", tokenizer_folder=folder)
    n = hf.config.vocab_size
    _patch_field(path, "llama.vocab_size", "<I", n - 50)
    raw = bytearray(path.read_bytes())
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"m.gguf: the tokenizer has token ids up to \d+, but the model has "
                                              rf"{n - 50} embedding rows|token_embd.weight' has shape"):
        exactspec.load(path)


@pytest.mark.parametrize("edit,exc,needle", [
    ({"sliding_window": None}, CheckpointError, r"field 'sliding_window' is None; layers of type 'sliding_attention' "
                                                r"need a window >= 1"),
    ({"layer_types": ["full_attention"] * 2}, CheckpointError, r"field 'layer_types' must list .* for each of the 6 "
                                                               r"layers"),
    ({"final_logit_softcapping": 30.0}, UnsupportedModelError, r"final_logit_softcapping=30\.0 is not supported"),
    ({"hidden_activation": "relu"}, UnsupportedModelError, r"hidden_activation='relu' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": -1.0}}},
     CheckpointError, r"rope_local_theta is -1\.0; expected a finite number > 0"),
])
def test_bad_gemma3_configs_are_named(ckpt, tmp_path, edit, exc, needle):
    """Gemma 3's own keys, each checked at load: a window missing where sliding layers need one, a layer list
    of the wrong length, logit soft-capping (Gemma 2's), another activation, a bad local RoPE base."""
    with pytest.raises(exc, match=needle):
        exactspec.load(edited_copy(ckpt("gemma3"), tmp_path / "g", edit))


def edited_copy(folder, dst, edit: dict):
    """A copy of checkpoint `folder` at `dst` with config.json's fields `edit` replaced."""
    import json
    import shutil
    folder = shutil.copytree(folder, dst)
    c = json.loads((folder / "config.json").read_text())
    c.update(edit)
    (folder / "config.json").write_text(json.dumps(c))
    return folder


def test_bad_gemma3_gguf_keys_are_named(tmp_path):
    """A GGUF sliding-window pattern listing the wrong number of layers: named at load."""
    hf = random_model("gemma3", query_pre_attn_scalar=32)
    path = write_gguf(hf, tmp_path / "m.gguf", arch="gemma3")
    rewrite_gguf(path, tmp_path / "p.gguf", {"gemma3.attention.sliding_window_pattern": [True, False]})
    with pytest.raises(CheckpointError, match=r"'gemma3\.attention\.sliding_window_pattern' lists 2 layers, the "
                                              r"model has 6"):
        exactspec.load(tmp_path / "p.gguf")


def rewrite_gguf(src, dst, fields: dict) -> None:
    """`src` copied to `dst` with metadata `fields` replaced or added (lists as arrays, ints as uint32)."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for f in r.fields.values():
        if f.name.startswith(("GGUF.", "general.architecture")) or f.name in fields:
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY
                        else None)
    for k, v in fields.items():
        if isinstance(v, list):
            w.add_array(k, v)
        else:
            w.add_uint32(k, v)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("old,new,needle", [
    (b"llama.attention.key_length", b"llama.attention.head_count", r"metadata field 'llama\.attention\.head_count' "
                                                                   r"appears twice"),
    (b"blk.0.attn_k.weight", b"blk.0.attn_q.weight", r"tensor 'blk\.0\.attn_q\.weight' appears twice"),
])
def test_a_key_or_tensor_named_twice_is_refused_by_name(tmp_path, old, new, needle):
    """The header reader keeps one value per key and one tensor per name: a second one is a named error, never
    a silent choice between the two."""
    path = write_gguf(random_model("llama"), tmp_path / "m.gguf")
    raw = path.read_bytes()
    assert raw.count(old) == 1
    (tmp_path / "dup.gguf").write_bytes(raw.replace(old, new))
    with pytest.raises(CheckpointError, match=needle):
        exactspec.load(tmp_path / "dup.gguf")
