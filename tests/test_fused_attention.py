"""FusedQKVAttention (the decoder's q, k and v projections as one matrix product) against transformers' own Qwen3-Omni
text attention module, whose weights it takes over: the same outputs, no copy of the weights, one compiled graph for
any length, and the attention left alone where the W4A4 replay hooks its projections."""

import pytest
import torch
from transformers.models.qwen3_omni_moe import (
    configuration_qwen3_omni_moe,
    modeling_qwen3_omni_moe,
)

import serve_clef

HEAD_DIM = 16


def attention_module(dtype: torch.dtype, seed: int = 0, bias: bool = False) -> torch.nn.Module:
    config = configuration_qwen3_omni_moe.Qwen3OmniMoeTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, attention_bias=bias)
    config._attn_implementation = "sdpa"
    attention = modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextAttention(config, layer_idx=0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in attention.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return attention.to(dtype).eval()


def attention_inputs(num_tokens: int, dtype: torch.dtype, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(1, num_tokens, 64, generator=generator).to(dtype)  # [B, T, H]
    angles = torch.randn(1, num_tokens, HEAD_DIM, generator=generator)  # [B, T, D]
    return hidden_states, (angles.cos().to(dtype), angles.sin().to(dtype))


@pytest.mark.parametrize(("dtype", "bias"), [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_fused_projections_attend_as_transformers_attention(dtype, bias):
    attention = attention_module(dtype, bias=bias)
    weights_before = {name: tensor.clone() for name, tensor in attention.state_dict().items()}
    hidden_states, position_embeddings = attention_inputs(37, dtype)
    with torch.inference_mode():
        expected, _ = attention(hidden_states, position_embeddings, None)
        assert serve_clef.FusedQKVAttention.fusable(attention)
        fused = serve_clef.FusedQKVAttention(attention)
        got, _ = fused(hidden_states, position_embeddings, None)
    assert torch.equal(got, expected)  # each output column is the same dot product, summed in the same order
    # the module's own weights are unchanged, and now views of the fused matrix: no second copy stays in memory
    for name, tensor in attention.state_dict().items():
        assert torch.equal(tensor, weights_before[name]), name
    for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert projection.weight.untyped_storage().data_ptr() == fused.qkv_weight.untyped_storage().data_ptr()
    assert fused.qkv_weight.shape == (4 * HEAD_DIM + 2 * 2 * HEAD_DIM, 64)


@pytest.mark.parametrize("norms_in_one_launch", [False, True], ids=["transformers' norms", "one launch"])
def test_fused_attention_compiles_into_one_graph_for_any_length(norms_in_one_launch):
    """Also with the norms and rotary embedding as one opaque op (norm_rotate_query_key, forced on: served on CUDA)."""
    fused = serve_clef.FusedQKVAttention(attention_module(torch.bfloat16, seed=3))
    fused.norms_in_one_launch = norms_in_one_launch
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    compiled = torch.compile(fused, dynamic=True)
    with torch.inference_mode():
        for num_tokens in (33, 70, 5):
            hidden_states, position_embeddings = attention_inputs(num_tokens, torch.bfloat16, seed=num_tokens)
            got, _ = compiled(hidden_states, position_embeddings, None)
            expected, _ = fused(hidden_states, position_embeddings, None)
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before + 1
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks_before


def test_hooked_or_partly_biased_projections_keep_transformers_attention():
    hooked = attention_module(torch.float32)
    serve_clef.replay_nvfp4_input_rounding(hooked.k_proj, torch.tensor(0.01))  # W4A4 replay of NVFP4 projections
    assert not serve_clef.FusedQKVAttention.fusable(hooked)
    partly_biased = attention_module(torch.float32)
    partly_biased.q_proj.bias = torch.nn.Parameter(torch.zeros(4 * HEAD_DIM))
    assert not serve_clef.FusedQKVAttention.fusable(partly_biased)
    assert not serve_clef.FusedQKVAttention.fusable(torch.nn.Linear(4, 4))


def test_a_kv_cache_is_refused():
    fused = serve_clef.FusedQKVAttention(attention_module(torch.float32))
    hidden_states, position_embeddings = attention_inputs(4, torch.float32)
    with pytest.raises(ValueError, match="no KV cache"):
        fused(hidden_states, position_embeddings, None, cache=object())


@pytest.mark.parametrize(("query_heads", "key_heads", "heads_a_program"), [(4, 2, 1), (8, 4, 2), (8, 4, 4)])
def test_the_norms_and_rotary_embedding_in_one_launch_as_transformers_computes_them(query_heads, key_heads,
                                                                                   heads_a_program, monkeypatch):
    """norm_rotate_query_key (Triton's interpreter here) against transformers' own q_norm, k_norm and
    apply_rotary_pos_emb in BF16, on the model's head size (128) with real rotary angles, and the whole attention
    with it, with one or several heads a program. It rounds where eager BF16 rounds; only the order of the norm's fp32
    sum of squares may differ."""
    monkeypatch.setattr(serve_clef, "NORM_ROTATE_HEADS", ((0, heads_a_program),))  # at any number of tokens
    config = configuration_qwen3_omni_moe.Qwen3OmniMoeTextConfig(
        hidden_size=256, num_attention_heads=query_heads, num_key_value_heads=key_heads, head_dim=128)
    config._attn_implementation = "sdpa"
    attention = modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextAttention(config, layer_idx=0)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in attention.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2 + (parameter.ndim == 1))
    attention = attention.to(torch.bfloat16).eval()
    num_tokens = 21  # not a multiple of the kernel's 16 tokens a program
    hidden_states = torch.randn(1, num_tokens, 256, generator=generator).to(torch.bfloat16)
    positions = torch.arange(num_tokens)[None, None].expand(3, 1, num_tokens) * torch.tensor([1, 2, 3])[:, None, None]
    cos, sin = modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextRotaryEmbedding(config)(hidden_states, positions)
    with torch.inference_mode():
        query = attention.q_norm(attention.q_proj(hidden_states).view(1, num_tokens, query_heads, 128)).transpose(1, 2)
        key = attention.k_norm(attention.k_proj(hidden_states).view(1, num_tokens, key_heads, 128)).transpose(1, 2)
        expected_query, expected_key = modeling_qwen3_omni_moe.apply_rotary_pos_emb(query, key, cos, sin)
        fused = serve_clef.FusedQKVAttention(attention)
        qkv = torch.nn.functional.linear(hidden_states, fused.qkv_weight)[0]  # [T, W]
        got_query, got_key = serve_clef.norm_rotate_query_key(qkv, attention.q_norm.weight, attention.k_norm.weight,
                                                              cos[0], sin[0], attention.q_norm.variance_epsilon,
                                                              query_heads, key_heads)
        for got, expected in ((got_query, expected_query), (got_key, expected_key)):
            assert got.shape == expected.transpose(1, 2)[0].shape
            differ = got.view(torch.int16) != expected.transpose(1, 2)[0].contiguous().view(torch.int16)
            assert differ.float().mean() < 0.002  # a BF16 rounding flipped by the sum's order, at most
            torch.testing.assert_close(got, expected.transpose(1, 2)[0], rtol=2**-7, atol=1e-3)
        # the whole attention through the one launch (forced on here, on CUDA only when served)
        expected_output, _ = attention(hidden_states, (cos, sin), None)
        fused.norms_in_one_launch = True
        got_output, _ = fused(hidden_states, (cos, sin), None)
    torch.testing.assert_close(got_output, expected_output, rtol=2e-2, atol=2e-2)
