"""A mixture of experts (Qwen3-MoE): the routing kernel against its twin and transformers' router, ties,
named errors for bad expert counts (the model-level invariance matrix, the fused-vs-twin and transformers
checks run with the other architectures: tests/helpers.ARCHS; a GGUF whose experts stay quantized:
tests/kernels/test_quantized.py, beside the dense file whose compiled forward it shares)."""
import pytest
import torch

import exactspec
from exactspec import kernels as K
from exactspec.errors import CheckpointError, UnsupportedModelError
from exactspec.tools.testing import random_model
from tests.model.test_gguf import edited_copy, rewrite_gguf, write_gguf


def _logits(rows, experts, seed, grid=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, experts, generator=g) * 3
    return torch.round(x * grid) / grid if grid else x  # a coarse grid: many exact ties


@pytest.mark.parametrize("experts,grid", [(8, None), (64, None), (8, 2), (64, 4)])
def test_routing_equals_its_twin_bitwise(experts, grid):
    x = _logits(37, experts, seed=experts, grid=grid)
    for k in (1, 3, experts):
        for norm in (False, True):
            idx, w = K.route(x, k, norm)
            ridx, rw = K.route_ref(x, k, norm)
            assert torch.equal(idx, ridx) and torch.equal(w, rw), (k, norm)


def test_ties_go_to_the_lower_expert():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    idx, w = K.route(x, 2, True)
    assert idx.tolist() == [[1, 2], [0, 1]]
    assert w.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    idx, _ = K.route(x, 4, False)
    assert idx.tolist() == [[1, 2, 4, 0], [0, 1, 2, 3]]


def test_routing_is_close_to_transformers_router():
    x = _logits(50, 64, seed=1)
    p = torch.softmax(x, dim=-1)
    top, want = torch.topk(p, 8, dim=-1)
    want_w = top / top.sum(-1, keepdim=True)
    idx, w = K.route(x, 8, True)
    assert torch.equal(idx, want)  # random logits: no ties
    assert (w - want_w).abs().max() < 1e-6


@pytest.mark.parametrize("edit,exc,needle", [
    ({"num_local_experts": 0}, CheckpointError, r"field 'num_experts' is 0; a mixture of experts needs at least one"),
    ({"num_experts_per_tok": 9}, CheckpointError, r"num_experts_per_tok is 9; expected 1 \.\. num_experts \(8\)"),
    ({"num_experts_per_tok": 0}, CheckpointError, r"num_experts_per_tok is 0"),
    ({"mlp_only_layers": [1]}, UnsupportedModelError, r"dense MLP layers among the experts"),
    ({"decoder_sparse_step": 2}, UnsupportedModelError, r"decoder_sparse_step=2"),
    ({"moe_intermediate_size": 0}, CheckpointError, r"field 'moe_intermediate_size' must be >= 1"),
])
def test_bad_expert_configs_are_named(ckpt, tmp_path, edit, exc, needle):
    with pytest.raises(exc, match=needle):
        exactspec.load(edited_copy(ckpt("qwen3moe"), tmp_path / "m", edit))


@pytest.mark.parametrize("fields,needle", [
    ({"qwen3moe.expert_count": 0}, r"metadata field 'qwen3moe\.expert_count' is 0, expected an integer >= 1"),
    ({"qwen3moe.expert_used_count": 9}, r"qwen3moe\.expert_used_count is 9; expected 1 \.\. qwen3moe\.expert_count \(8\)"),
    ({"qwen3moe.expert_count": 4}, r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \(8, 64, 64\), the metadata "
                                   r"implies \(4, 64, 64\)"),
])
def test_bad_expert_gguf_keys_are_named(tmp_path, fields, needle):
    path = write_gguf(random_model("qwen3moe"), tmp_path / "m.gguf", arch="qwen3moe")
    rewrite_gguf(path, tmp_path / "p.gguf", fields)
    with pytest.raises(CheckpointError, match=needle):
        exactspec.load(tmp_path / "p.gguf")
