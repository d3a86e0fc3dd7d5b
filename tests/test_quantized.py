"""Q8_0 weights kept quantized (dequantized in registers inside the linear kernel): bitwise the
float kernel on the dequantized weights, for every row count, tile height and thread count; a
Q8_0 GGUF file kept quantized computes bitwise what the same file dequantized to float32 computes;
an HF folder quantized at load equals the Q8_0 GGUF of the same weights."""
import gguf
import numpy as np
import pytest
import torch

import exactspec
from exactspec import kernels as K
from exactspec import tile
from exactspec.gguf_file import quantize_q8
from exactspec.testing import random_model
from test_gguf import _ids, write_gguf

Q8 = gguf.GGMLQuantizationType.Q8_0


def _q8(w: np.ndarray, bias=None) -> K.PackedWeight:
    return K.pack_q8(*quantize_q8(torch.from_numpy(w)), bias)


@pytest.mark.parametrize("n,k,bias", [(77, 64, False), (100, 96, True), (32, 32, False)])
def test_q8_linear_is_the_float_kernel_on_dequantized_weights(n, k, bias):
    rng = np.random.default_rng(n)
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = torch.randn(n) if bias else None
    pq = _q8(w, b)
    deq = gguf.quants.dequantize(gguf.quants.quantize(w, Q8), Q8).reshape(n, k)
    assert np.array_equal(pq.unpack().numpy(), deq)  # the value of each weight is defined once
    pf = K.pack_weight(torch.from_numpy(deq), b)
    M = 3 * K.MR_MAX + 2
    x = torch.randn(M, k) * torch.logspace(-3, 3, k)  # many exponents: real roundings
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


def test_every_float16_scale_widens_exactly():
    hs = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    hs = hs[np.isfinite(hs) & ~((hs == 0) & np.signbit(hs))]  # -0 * 1 + (+0) is +0 in any chain
    hs = hs[: len(hs) // 32 * 32]
    pq = K.pack_q8(np.ones((len(hs), 32), np.int8), hs.reshape(-1, 1))
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    got = K.linear(x, pq)[0].numpy()
    assert np.array_equal(got.view(np.uint32), hs.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q8_gguf_kept_quantized_equals_it_dequantized(arch, tmp_path):
    hf = random_model(arch, hidden=64)
    path = write_gguf(hf, tmp_path / "m.gguf", Q8, arch=arch)
    kept, deq = exactspec.load(path), exactspec.load(path, dtype="float32")
    L = kept.net.layers[0]
    assert all(w.q8 for w in (L.wqkv, L.wo, L.w_gate, L.w_up, L.w_down, kept.net.lm_head))
    assert not deq.net.layers[0].wqkv.q8
    V = kept.cfg.vocab_size
    every = torch.arange(V)
    assert torch.equal(kept.net.embed_rows(every), deq.net.embed_rows(every))  # looked up from the Q8_0 blocks
    if kept.cfg.tie_word_embeddings:  # one copy: the lookup reads the packed head
        assert kept.net._embed_np is kept.net.lm_head.data
    ids = _ids()
    assert torch.equal(kept.logits(ids), deq.logits(ids))
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


def test_hf_folder_quantized_at_load_equals_the_q8_gguf(ckpt, tmp_path):
    path = write_gguf(random_model("llama"), tmp_path / "m.gguf", Q8)  # the folder's weights, quantized by gguf
    a, b = exactspec.load(ckpt("llama"), quantize="q8_0"), exactspec.load(path)
    assert a.net.layers[1].w_down.q8 and b.net.layers[1].w_down.q8
    ids = _ids()
    assert torch.equal(a.logits(ids), b.logits(ids))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculative_with_q8_target_and_q8_draft_is_the_q8_target_alone(ckpt, temperature):
    target = exactspec.load(ckpt("qwen3"), quantize="q8_0")
    draft = exactspec.load(ckpt("llama", seed=7, layers=1, hidden=32), quantize="q8_0")
    prompts = [[5, 6, 7, 8], list(range(30, 70)), [9, 9, 9]]
    kw = dict(temperature=temperature, seed=3, ignore_eos=True)
    alone = [target.generate(p, 48, **kw).token_ids for p in prompts]
    for k in (1, 4, "dynamic"):
        got = target.generate_batch(prompts, 48, draft=draft, num_draft_tokens=k, **kw)
        assert [r.token_ids for r in got] == alone, k


def test_q8_weights_take_17_bytes_per_16_weights(ckpt):
    m = exactspec.load(ckpt("llama", hidden=128), quantize="q8_0")
    st = m.net.stack
    q8_bytes = sum(a.nbytes for name, a in st.arrays.items() if a.dtype == np.uint8)
    weights = st.work  # multiply-adds per row = weights of every layer's linears
    assert q8_bytes == weights * tile.GROUP_BYTES // (tile.QK * tile.NL)  # N is a multiple of 32 here
    assert tile.GROUP_BYTES / (tile.QK * tile.NL) == 1.0625  # as a GGUF Q8_0 block: 34 bytes per 32


def test_bad_quantize_and_dtype_are_named(ckpt):
    with pytest.raises(exactspec.UnsupportedModelError, match="quantize='q4_k'"):
        exactspec.load(ckpt("llama"), quantize="q4_k")
    with pytest.raises(exactspec.UnsupportedModelError, match="rows of 48 values"):
        exactspec.load(ckpt("llama", hidden=48), quantize="q8_0")
