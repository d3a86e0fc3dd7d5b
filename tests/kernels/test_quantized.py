"""Block-quantized weights kept quantized (Q8_0, Q4_0, Q4_1, Q4_K; with activations="float32"
dequantized in registers inside the linear kernel): each weight's value is the gguf package's
dequantization; the kernel is bitwise the float kernel on the dequantized weights, for every row count, tile height and thread count; a
quantized GGUF file kept quantized computes bitwise what the same file dequantized to float32
computes; an HF folder quantized at load equals the GGUF of the same weights."""
import gguf
import numpy as np
import pytest
import torch

import exactspec
from exactspec import kernels as K
from exactspec.kernels import quant
from exactspec.kernels import layout
from exactspec.tools.testing import K_QUANT_BLOCKS as KQ, random_model
from tests.model.test_gguf import _ids, write_gguf
from tests.model.test_model import _chunks, _decode_logits

FORMATS = quant.FORMATS
TYPE = {f: getattr(gguf.GGMLQuantizationType, f.upper()) for f in FORMATS}


def _blocks(w: np.ndarray, fmt: str) -> np.ndarray:
    """w in fmt's GGUF blocks: the gguf package's quantizer; Q4_K (none there): random valid blocks."""
    if fmt in KQ:
        return KQ[fmt](*w.shape, seed=w.shape[0])
    return gguf.quants.quantize(w, TYPE[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
def test_gguf_blocks_split_and_pack_without_loss(fmt):
    rng = np.random.default_rng(1)
    k = 512 if fmt in KQ else 96
    w = rng.standard_normal((70, k)).astype(np.float32) * np.logspace(-2, 2, k, dtype=np.float32)
    raw = _blocks(w, fmt)
    ref = gguf.quants.dequantize(raw, TYPE[fmt]).reshape(70, k)
    q = quant.from_blocks(raw, fmt, 70, k)
    assert np.array_equal(q.dequantize().view(np.uint32), ref.view(np.uint32))  # each value defined once
    p = K.pack_quant(q)
    assert p.fmt == fmt and p.quantized
    assert np.array_equal(p.unpack().numpy().view(np.uint32), ref.view(np.uint32))
    F = layout.LAYOUTS[fmt]
    assert p.data.nbytes == 3 * (k // (32 * F.groups)) * F.record_bytes  # 3 blocks of 32 rows, no more


@pytest.mark.parametrize("fmt", sorted(KQ))
def test_a_super_block_with_two_scales_is_refused_not_packed_wrong(fmt):
    """A K-quant record keeps its super-block's d (and dmin) once: groups that disagree cannot be packed."""
    q = quant.from_blocks(KQ[fmt](32, 256, seed=3), fmt, 32, 256)
    K.pack_quant(q)
    q.d[5, 3] = np.float16(q.d[5, 3] * 2 + 1)
    with pytest.raises(ValueError, match="super-block's groups have different d"):
        K.pack_quant(q)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,bias", [(77, 64, False), (100, 96, True), (32, 32, False)])
def test_quantized_linear_is_the_float_kernel_on_dequantized_weights(fmt, n, k, bias):
    rng = np.random.default_rng(n)
    k = k * 8 if fmt in KQ else k  # whole super-blocks of 256
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[: n // 3] += 3.0  # Q4_1 blocks with a large minimum: d * q + m rounds
    g = torch.Generator().manual_seed(n)
    b = torch.randn(n, generator=g) if bias else None
    raw = _blocks(w, fmt)
    pq = K.pack_quant(quant.from_blocks(raw, fmt, n, k), b)
    deq = gguf.quants.dequantize(raw, TYPE[fmt]).reshape(n, k)
    assert np.array_equal(pq.unpack().numpy(), deq)
    pf = K.pack_weight(torch.from_numpy(deq), b)
    M = 3 * K.MR_MAX + 2
    x = torch.randn(M, k, generator=g) * torch.logspace(-3, 3, k)  # many exponents: real roundings
    whole = K.linear(x, pq)
    assert torch.equal(whole, K.linear(x, pf))
    assert torch.equal(whole, K.linear_ref(x, torch.from_numpy(deq), b))  # the plain-torch FMA chain
    for m in range(1, M + 1):  # every tile height: a row's bits never depend on the rows beside it
        assert torch.equal(K.linear(x[:m], pq), whole[:m])
    K.set_num_threads(1)
    try:
        assert torch.equal(K.linear(x, pq), whole)
    finally:
        K.set_num_threads(2)


@pytest.mark.parametrize("src,dst", [("q4_0", "q5_0"), ("q4_0", "q8_0"), ("q5_0", "q8_0"), ("q4_1", "q5_1"),
                                     ("q4_k", "q5_k")])
def test_a_format_widens_to_the_same_weights_and_the_same_products(src, dst):
    """quant.widen: every weight's value, and every row of both linear paths (float FMA chains, integer
    dots on int8 rows), bitwise the narrower format's -- what lets a kind in three formats fold into two."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    w[:20] += 3.0  # large minimums
    t = quant.from_blocks(_blocks(w, src), src, 64, 256)
    wide = quant.widen(t, dst)
    assert wide.fmt == dst and np.array_equal(wide.dequantize().view(np.uint32), t.dequantize().view(np.uint32))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 256)
    for int_dot in (False, True):
        a, b = K.pack_quant(t, None, int_dot), K.pack_quant(wide, None, int_dot)
        assert b.fmt == dst + ("i" if int_dot else "")
        assert torch.equal(K.linear(x, a), K.linear(x, b)) and torch.equal(K.linear(x[3:4], a), K.linear(x[3:4], b))
    with pytest.raises(ValueError, match="does not widen"):
        quant.widen(wide, src)


def test_formats_fold_by_widening_the_fewest_bytes():
    from exactspec.model.pack import fold
    assert fold(("q4_k", "q6_k", "q5_k", "q4_k"), 2) == ("q5_k", "q6_k", "q5_k", "q5_k")
    assert fold(("q4_0", "q5_0", "q8_0", "q8_0", "q8_0"), 2) == ("q5_0", "q5_0", "q8_0", "q8_0", "q8_0")  # not q5_0 -> q8_0
    assert fold(("q4_0", "q8_0", "q4_k"), 2) == ("q8_0", "q8_0", "q4_k")  # the nearest wider one present
    assert fold(("q4_0", "q5_0", "q8_0"), 1) == ("q8_0",) * 3
    assert fold(("q4_k", "q6_k", "q8_0"), 2) is None  # no widening joins them: the kind stays float
    assert fold(("q4_k", "q6_k"), 2) == ("q4_k", "q6_k")  # within the limit: as stored


@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_rows_are_looked_up_from_the_blocks(fmt):
    from exactspec.model import forward as F
    rng = np.random.default_rng(5)
    w = rng.standard_normal((77, 256)).astype(np.float32)
    p = K.pack_quant(quant.from_blocks(_blocks(w, fmt), fmt, 77, 256))
    tokens = np.array([0, 76, 31, 32, 15, 16, 5, 5], np.int64)  # both nibbles, both ends, a repeat
    got = F.embed_rows(p.data, tokens, 256)
    assert np.array_equal(got.view(np.uint32), p.unpack().numpy()[tokens].view(np.uint32))


def test_every_float16_scale_widens_exactly():
    hs = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    hs = hs[np.isfinite(hs) & ~((hs == 0) & np.signbit(hs))]  # -0 * 1 + (+0) is +0 in any chain
    hs = hs[: len(hs) // 32 * 32]
    pq = K.pack_quant(quant.Quantized("q8_0", np.ones((len(hs), 32), np.int8), hs.reshape(-1, 1)))
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    got = K.linear(x, pq)[0].numpy()
    assert np.array_equal(got.view(np.uint32), hs.astype(np.float32).view(np.uint32))


# A file whose kinds of weight each have their own format, and some kinds one format in some layers and
# another in the rest (as llama.cpp's Q4_K_M: Q4_K, with Q6_K v and down in some layers); "blk.N."
# names one layer's tensor. v apart from q and k; one compiled forward covers it all (each new
# combination of weight types costs a compile).
KINDS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
         "ffn_down.weight", "token_embd.weight", "output.weight")
# (The random Q4_K blocks' weights have a large positive mean: on q/k they make attention a near argmax,
# on down a huge residual, either of which int8 rounding's 0.5% per linear turns into 26% in the
# logits. So q, k and down are from the model's weights or Q6_K's centred random blocks.)
MIXED = {"attn_q.weight": "q4_0", "attn_k.weight": "q4_0", "blk.0.attn_v.weight": "q6_k", "blk.1.attn_v.weight": "q4_0",
         "blk.0.attn_output.weight": "q5_0", "blk.1.attn_output.weight": "q4_0", "blk.0.ffn_gate.weight": "q4_k",
         "blk.0.ffn_up.weight": "q4_k", "blk.1.ffn_gate.weight": "q5_k", "blk.1.ffn_up.weight": "q5_k",
         "blk.0.ffn_down.weight": "q6_k", "blk.1.ffn_down.weight": "q5_1",
         "token_embd.weight": "q5_1"}
ALL_Q8 = dict.fromkeys(KINDS, "q8_0")


def _stored(fmts: dict, layer: int, name: str) -> str:
    return fmts.get(f"blk.{layer}.{name}", fmts.get(name))


def _assert_kept(m, fmts: dict, suffix: str = "") -> None:
    """Every layer's weights in the file's format of that layer (v apart where it differs from q, k)."""
    apart = any(_stored(fmts, i, "attn_v.weight") != _stored(fmts, i, "attn_q.weight") for i in range(m.cfg.n_layers))
    for i, L in enumerate(m.net.layers):
        got = {"attn_q.weight": L.wqkv, "attn_output.weight": L.wo, "ffn_gate.weight": L.w_gate,
               "ffn_up.weight": L.w_up, "ffn_down.weight": L.w_down}
        if apart:
            got["attn_v.weight"] = L.wv
        else:
            assert L.wv is None
        assert {n: w.fmt for n, w in got.items()} == {n: _stored(fmts, i, n) + suffix for n in got}, i
    head = "token_embd.weight" if m.cfg.tie_word_embeddings else "output.weight"
    assert m.net.lm_head.fmt == fmts[head] + suffix
    assert m.net.dtype == "+".join(sorted(set(fmts.values())) + ["float32"])  # nothing dequantized


def _assert_twin(net, ids: list[int]) -> None:
    """The one-call forward == its per-kernel twin (forward_ref), the file's formats as they are."""
    t = torch.tensor(ids)
    z, p = torch.zeros_like(t), torch.arange(len(ids))
    assert torch.equal(net.forward(t, z, p, net.new_cache(1, 64)), net.forward_ref(t, z, p, net.new_cache(1, 64)))


def test_a_kind_in_three_formats_is_widened_not_dequantized(tmp_path):
    """down in Q6_K, Q5_1 and Q4_1 over three layers: Q4_1 is widened to Q5_1 (two stacks, no float copy),
    the dequantized model's bits (float activations), and a function of each row with int8 activations.
    (The other kinds as MIXED's two layers: after the fold every kind has MIXED's types, one compiled forward.)"""
    fmts = {**MIXED, "blk.2.attn_v.weight": "q4_0", "blk.2.attn_output.weight": "q4_0", "blk.2.ffn_gate.weight": "q5_k",
            "blk.2.ffn_up.weight": "q5_k", "blk.2.ffn_down.weight": "q4_1"}
    hf = random_model("qwen2", hidden=256, layers=3)
    path = write_gguf(hf, tmp_path / "m.gguf", arch="qwen2", types={n: TYPE[f] for n, f in fmts.items()})
    kept, deq, m = (exactspec.load(path, activations="float32"), exactspec.load(path, dtype="float32"),
                    exactspec.load(path))
    assert [L.w_down.fmt for L in kept.net.layers] == ["q6_k", "q5_1", "q5_1"]
    assert [L.w_down.fmt for L in m.net.layers] == ["q6_ki", "q5_1i", "q5_1i"]
    st = kept.net.stack.arrays
    assert [st["sel_w_down"].tolist(), st["w_down"].shape[0], st["w_down_alt"].shape[0]] == [[0, -1, -2], 1, 2]
    assert all(a.dtype.names for n, a in st.items() if n.startswith("w") and a.shape[0])  # nothing dequantized
    ids = _ids()
    assert torch.equal(kept.logits(ids), deq.logits(ids))
    whole = m.logits(ids)
    assert torch.equal(torch.cat([m.logits(ids[: i + 1])[-1:] for i in range(0, len(ids), 7)]), whole[::7])


@pytest.mark.parametrize("arch,fmts", [("llama", ALL_Q8), ("qwen2", ALL_Q8), ("qwen2", MIXED)], ids=["llama-q8_0",
                         "qwen2-q8_0", "qwen2-mixed"])
def test_quantized_gguf_kept_quantized_equals_it_dequantized(arch, fmts, tmp_path):
    hf = random_model(arch, hidden=256 if fmts is MIXED else 64)  # Q4_K: rows of whole super-blocks
    path = write_gguf(hf, tmp_path / "m.gguf", arch=arch, types={n: TYPE[f] for n, f in fmts.items()})
    kept, deq = exactspec.load(path, activations="float32"), exactspec.load(path, dtype="float32")
    _assert_kept(kept, fmts)
    assert not deq.net.layers[0].wqkv.quantized
    if fmts is MIXED:  # one stack per format: each layer's weight where sel_ says, no float copy
        st = kept.net.stack.arrays
        assert [st["sel_wv"].tolist(), st["wv"].shape[0], st["wv_alt"].shape[0]] == [[0, -1], 1, 1]
        assert [st["sel_wqkv"].tolist(), st["wqkv_alt"].shape[0]] == [[0, 1], 0]
        weights = [a for n, a in st.items() if n.startswith("w") and a.shape[0]] + [kept.net.lm_head.data]
        assert all(a.dtype.names for a in weights)  # every matrix in a quantized layout
        stored = sum(t.n_bytes for t in gguf.GGUFReader(path).tensors if t.tensor_type.name.startswith("Q"))
        packed = sum(a.nbytes for a in weights)  # (Q4_K: 22 bytes per 32 where the file has 18, Q5_K 26/22)
        assert stored < packed < 1.2 * stored, (packed, stored)
    V = kept.cfg.vocab_size
    every = torch.arange(V)
    assert torch.equal(kept.net.embed_rows(every), deq.net.embed_rows(every))  # looked up from the blocks
    if kept.cfg.tie_word_embeddings:  # one copy: the lookup reads the packed head
        assert np.shares_memory(kept.net._embed_np, kept.net.lm_head.data)
    ids = _ids()
    assert torch.equal(kept.logits(ids), deq.logits(ids))
    _assert_twin(kept.net, ids)
    if fmts is ALL_Q8:  # (MIXED's Q4_K blocks are random, not the model's weights quantized)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (kept.logits(ids) - ref).abs().max() < 0.1 * ref.abs().max()  # quantization error, not a layout bug
    g = kept.generate(ids, 40, ignore_eos=True)
    assert g.token_ids == deq.generate(ids, 40, ignore_eos=True).token_ids
    assert kept.generate(ids, 40, ignore_eos=True, draft="lookup", num_draft_tokens=3).token_ids == g.token_ids
    batch = kept.generate_batch([ids[:7], ids, ids[3:20]], 40, ignore_eos=True)
    assert batch[1].token_ids == g.token_ids
    K.set_num_threads(1)
    try:
        assert kept.generate(ids, 40, ignore_eos=True).token_ids == g.token_ids
    finally:
        K.set_num_threads(2)


@pytest.mark.parametrize("arch,fmts", [("llama", ALL_Q8), ("qwen2", MIXED)], ids=["llama-q8_0", "qwen2-mixed"])
def test_int8_activations_are_invariant_and_close_to_the_float_path(arch, fmts, tmp_path):
    """The default for quantized weights: integer dot products. Not the float path's bits (the activations
    are rounded to int8), but a function of each row alone: rows == solo rows, greedy == lookup ==
    batched == 1 thread, and within the int8 rounding of the float path."""
    hf = random_model(arch, hidden=256 if fmts is MIXED else 64)
    path = write_gguf(hf, tmp_path / "m.gguf", arch=arch, types={n: TYPE[f] for n, f in fmts.items()})
    m, flt = exactspec.load(path), exactspec.load(path, activations="float32")
    assert m.net.activations == "int8" and flt.net.activations == "float32"
    _assert_kept(m, fmts, "i")
    ids = _ids()
    whole = m.logits(ids)  # (the per-kernel twin: checked on the float path, the same Stack)
    assert torch.equal(torch.cat([m.logits(ids[: i + 1])[-1:] for i in range(len(ids))]), whole)
    ref = flt.logits(ids)
    assert (whole - ref).norm() / ref.norm() < 0.05
    g = m.generate(ids, 40, ignore_eos=True)
    assert m.generate(ids, 40, ignore_eos=True, draft="lookup", num_draft_tokens=3).token_ids == g.token_ids
    assert m.generate_batch([ids[:7], ids, ids[3:20]], 40, ignore_eos=True)[1].token_ids == g.token_ids
    K.set_num_threads(1)
    try:
        assert m.generate(ids, 40, ignore_eos=True).token_ids == g.token_ids
    finally:
        K.set_num_threads(2)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])  # (Q4_0 quantizes by the same path; gguf has no Q4_K quantizer)
def test_hf_folder_quantized_at_load_equals_the_gguf(ckpt, fmt, tmp_path):
    path = write_gguf(random_model("llama"), tmp_path / "m.gguf", TYPE[fmt])  # the folder's weights, by gguf
    a, b = exactspec.load(ckpt("llama"), quantize=fmt), exactspec.load(path)
    assert a.net.layers[1].w_down.fmt == fmt + "i" and b.net.layers[1].w_down.fmt == fmt + "i"  # int8 activations
    ids = _ids()
    assert torch.equal(a.logits(ids), b.logits(ids))


def test_a_file_of_mixed_formats_keeps_each_kind_in_its_own(tmp_path):
    """As SmolLM2's Q4_1 file: Q4_1 layers, a Q8_0 embedding."""
    hf = random_model("llama", hidden=64)
    path = write_gguf(hf, tmp_path / "m.gguf", TYPE["q4_1"], embed_type=TYPE["q8_0"])
    kept, deq = exactspec.load(path, activations="float32"), exactspec.load(path, dtype="float32")
    assert kept.net.layers[0].w_down.fmt == "q4_1"
    assert kept.net._embed_np.shape[2] == layout.GROUP_BYTES  # Q8_0 groups
    assert kept.net.lm_head.fmt == ("q8_0" if kept.cfg.tie_word_embeddings else "q4_1")
    assert kept.net.dtype == "q4_1+q8_0+float32"
    ids = _ids()
    assert torch.equal(kept.logits(ids), deq.logits(ids))


@pytest.mark.parametrize("temperature,fmt", [(0.0, "q8_0"), (0.9, "q8_0"), (0.0, "q4_1"), (0.9, "q4_1")])
def test_speculative_with_quantized_target_and_draft_is_the_target_alone(ckpt, temperature, fmt):
    target = exactspec.load(ckpt("qwen3"), quantize=fmt)
    draft = exactspec.load(ckpt("llama", seed=7, layers=1, hidden=32), quantize=fmt)
    prompts = [[5, 6, 7, 8], list(range(30, 70)), [9, 9, 9]]
    kw = dict(temperature=temperature, seed=3, ignore_eos=True)
    alone = [target.generate(p, 48, **kw).token_ids for p in prompts]
    for k in (1, 4, "dynamic"):
        got = target.generate_batch(prompts, 48, draft=draft, num_draft_tokens=k, **kw)
        assert [r.token_ids for r in got] == alone, k


@pytest.mark.parametrize("fmt,bytes_per_32", [("q8_0", 34), ("q4_0", 18), ("q4_1", 20)])
def test_quantized_weights_take_the_bytes_of_their_gguf_blocks(ckpt, fmt, bytes_per_32):
    m = exactspec.load(ckpt("llama", hidden=128), quantize=fmt)
    st = m.net.stack
    qbytes = sum(a.nbytes for name, a in st.arrays.items() if name.startswith("w"))
    weights = st.work  # multiply-adds per row = weights of every layer's linears
    assert qbytes == weights * layout.LAYOUTS[fmt].record_bytes // (layout.QK * layout.NL)  # N is a multiple of 32 here
    assert layout.LAYOUTS[fmt].record_bytes * 32 == bytes_per_32 * layout.QK * layout.NL
    # The K-quants (kept from files only) keep a super-block's d (and dmin) once, as the file: Q6_K 26.25
    # bytes per 32 weights, the file's; Q4_K 18.5 where the file has 18 (its 6-bit scale and minimum of a
    # group packed, a byte each here)
    for fmt, per_32 in (("q4_k", 18.5), ("q5_k", 22.5), ("q6_k", 26.25)):
        F = layout.LAYOUTS[fmt]
        assert F.record_bytes * 32 == per_32 * layout.QK * layout.NL * F.groups


def test_bad_quantize_and_dtype_are_named(ckpt):
    with pytest.raises(exactspec.UnsupportedModelError, match="quantize='q5_k'"):
        exactspec.load(ckpt("llama"), quantize="q5_k")
    with pytest.raises(exactspec.UnsupportedModelError, match="quantize='q4_k' is not supported.*Q4_K, Q5_0, Q5_1, Q5_K, Q6_K weights are kept"):
        exactspec.load(ckpt("llama"), quantize="q4_k")
    with pytest.raises(exactspec.UnsupportedModelError, match="rows of 48 values, not whole blocks of 32"):
        exactspec.load(ckpt("llama", hidden=48), quantize="q8_0")


def test_a_gguf_keeps_its_experts_quantized_and_exact(tmp_path):
    """Experts in a layer's own format (test_quantized's MIXED: Q4_K / Q6_K experts in layer 0, Q5_K / Q5_1 in
    layer 1, Q4_0 / Q5_0 / Q6_K attention; the same compiled forward as its dense qwen2 file), the router in
    F32. Kept quantized with float activations: the dequantized model's bits. With int8 activations (integer
    dots): the same bits whatever the chunking, greedy == lookup == a batch == 1 thread, close to the float
    path (the router sharpened, so that int8 rounding does not flip a row's experts)."""
    hf = random_model("qwen3moe", hidden=256, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                      tie_word_embeddings=True)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.mul_(40.0)
    types = {n.replace("ffn_gate.", "ffn_gate_exps.").replace("ffn_up.", "ffn_up_exps.").replace("ffn_down.",
             "ffn_down_exps."): TYPE[f] for n, f in MIXED.items()}
    path = write_gguf(hf, tmp_path / "m.gguf", arch="qwen3moe", types=types)
    kept, deq = exactspec.load(path, activations="float32"), exactspec.load(path, dtype="float32")
    L0, L1 = kept.net.layers
    assert [w.fmt for w in L0.experts[5]] == ["q4_k", "q4_k", "q6_k"]
    assert [w.fmt for w in L1.experts[7]] == ["q5_k", "q5_k", "q5_1"]
    assert L0.w_router.fmt == "f32" and not deq.net.layers[0].experts[0][0].quantized
    ids = _ids(48)
    flt = kept.logits(ids)
    assert torch.equal(flt, deq.logits(ids))
    m = exactspec.load(path)
    assert m.net.layers[1].experts[3][2].fmt == "q5_1i"
    full = m.logits(ids)
    assert (full - flt).norm() / flt.norm() < 0.05
    assert torch.equal(_decode_logits(m, ids, [1] * len(ids)), full)
    assert torch.equal(_decode_logits(m, ids, _chunks(len(ids), 5, first=3)), full)
    plain = m.generate(ids, 32, ignore_eos=True).token_ids
    assert m.generate(ids, 32, ignore_eos=True, draft="lookup", num_draft_tokens=4).token_ids == plain
    assert m.generate_batch([ids[:7], ids, ids[:20]], 32, ignore_eos=True)[1].token_ids == plain
    K.set_num_threads(1)
    try:
        assert m.generate(ids, 32, ignore_eos=True).token_ids == plain
    finally:
        K.set_num_threads(2)
