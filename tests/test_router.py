"""The router's choice in one kernel (`route_top_k`, run here by Triton's interpreter) against its formula, and the
FusedTopKRouter that serves it on CUDA against transformers' own Qwen3-Omni router.

The formula is transformers' router's: the softmax of the logits in fp32, the K largest probabilities, renormalised to
sum 1 (when the config says so), rounded to BF16. BF16 logits are often exactly equal, so which of two equal
probabilities is chosen matters: the kernel takes the lower expert, a fixed rule, where torch.topk leaves the choice
unspecified (and takes the other here on CPU), so the comparison with transformers' router leaves out the tokens whose
K-th and next probabilities are equal. bench/check_engine_gpu.py makes the same comparison on the GPU, where the
kernel's exp and torch's may also differ in the last bits.
"""

import types

import pytest
import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe

import serve_clef


def formula(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice computed plainly: equal probabilities ordered by expert (a stable sort)."""
    probabilities = router_logits.float().softmax(dim=-1)  # [T, E]
    ordered, experts = probabilities.sort(dim=-1, descending=True, stable=True)
    chosen, chosen_experts = ordered[:, :top_k], experts[:, :top_k]
    if normalize:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return chosen.to(torch.bfloat16), chosen_experts


def random_logits(num_tokens: int, num_experts: int, seed: int, step: float | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(num_tokens, num_experts, generator=generator)
    if step is not None:  # coarse logits: many equal ones, at the K-th place too
        logits = (logits / step).round() * step
    return logits.to(torch.bfloat16)


@pytest.mark.parametrize(("num_experts", "top_k", "num_tokens", "normalize", "step"), [
    (128, 8, 517, True, None),  # Qwen3-Omni's router, a few hundred tokens
    (128, 8, 70, True, 0.25),  # ties everywhere
    (128, 8, 1, True, None),
    (8, 2, 33, True, 0.5),  # the tiny synthetic model's router
    (6, 2, 5, False, None),  # experts not a power of two, no renormalisation
])
def test_route_top_k_is_the_formula(num_experts, top_k, num_tokens, normalize, step):
    router_logits = random_logits(num_tokens, num_experts, seed=num_tokens, step=step)
    top_k_weights, top_k_index = serve_clef.route_top_k(router_logits, top_k, normalize)
    expected_weights, expected_index = formula(router_logits, top_k, normalize)
    assert top_k_weights.dtype == torch.bfloat16 and top_k_index.dtype == torch.int64
    assert torch.equal(top_k_index, expected_index)
    assert torch.equal(top_k_weights, expected_weights)


def test_ties_go_to_the_lower_expert():
    router_logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.0]], dtype=torch.bfloat16)  # 3 at 1 and 3, 2 at 2 and 4
    _, top_k_index = serve_clef.route_top_k(router_logits, 3, True)
    assert top_k_index.tolist() == [[1, 3, 2]]


def test_fused_router_chooses_as_transformers_router():
    config = types.SimpleNamespace(num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, hidden_size=64)
    router = modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.2, generator=torch.Generator().manual_seed(0))
    router = router.to(torch.bfloat16)
    fused = serve_clef.FusedTopKRouter(router)
    hidden_states = torch.randn(300, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        logits, weights, experts = router(hidden_states)
        fused_logits, fused_weights, fused_experts = fused(hidden_states)
    assert torch.equal(fused_logits, logits)
    # each token's choice as a dense [T, E] row of weights, so that the order of the K chosen does not matter
    dense = torch.zeros(300, 128).scatter_(1, experts, weights.float())
    fused_dense = torch.zeros(300, 128).scatter_(1, fused_experts, fused_weights.float())
    ordered = logits.float().softmax(dim=-1).sort(dim=-1, descending=True).values
    no_tie_at_the_cut = ordered[:, 7] != ordered[:, 8]  # [T]
    assert no_tie_at_the_cut.sum() > 250
    assert torch.equal(fused_dense[no_tie_at_the_cut], dense[no_tie_at_the_cut])


def test_fused_router_compiles_into_one_graph_for_any_length():
    """In the compiled decoder layers the fused router is one opaque op: no graph break, one graph for every token
    count (dynamic shapes), and the compiled outputs are the eager ones."""
    config = types.SimpleNamespace(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, hidden_size=32)
    router = modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextTopKRouter(config)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(2))
    fused = serve_clef.FusedTopKRouter(router.to(torch.bfloat16))
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    compiled = torch.compile(fused, dynamic=True)
    with torch.inference_mode():
        for num_tokens in (33, 70, 5):
            hidden_states = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(num_tokens))
            hidden_states = hidden_states.to(torch.bfloat16)
            for got, expected in zip(compiled(hidden_states), fused(hidden_states)):
                assert torch.equal(got, expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before + 1
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks_before
