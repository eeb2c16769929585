"""route_to_row_tiles, the routing kernels of the packed experts, run on CPU by Triton's interpreter
(TRITON_INTERPRET=1, set in conftest.py), against a plain numpy stable grouping written here.

Dimension letters: T tokens, K experts per token, S = T * K pairs, E experts, R rows per tile, P padded slots.
"""

import numpy as np
import pytest
import torch

import serve_clef


def reference_row_tiles(top_k_index: torch.Tensor, num_experts: int, block_rows: int,
                        real_tokens: int | None = None):
    """Expert by expert, its pairs (token * K + k) in increasing order, then -1 up to a whole number of tiles; then
    tiles of -1 marked with expert num_experts up to the most tiles any routing of S pairs can need; and a zero
    count of finished gate_up columns per tile. The pairs of the tokens from real_tokens on (padding) take no
    slot."""
    expert_of_pair = top_k_index.reshape(-1).numpy().copy()
    num_pairs = expert_of_pair.size
    if real_tokens is not None:
        expert_of_pair[real_tokens * top_k_index.shape[1]:] = -1
    slot_pairs, tile_experts = [], []
    for expert in range(num_experts):
        pairs = np.flatnonzero(expert_of_pair == expert).tolist()
        tiles = -(-len(pairs) // block_rows)
        slot_pairs += pairs + [-1] * (tiles * block_rows - len(pairs))
        tile_experts += [expert] * tiles
    max_tiles = -(-num_pairs // block_rows) + min(num_experts, num_pairs)
    assert len(tile_experts) <= max_tiles  # the bound the grid is sized by
    slot_pairs += [-1] * (max_tiles * block_rows - len(slot_pairs))
    tile_experts += [num_experts] * (max_tiles - len(tile_experts))
    return (torch.tensor(slot_pairs, dtype=torch.int32), torch.tensor(tile_experts, dtype=torch.int32),
            torch.zeros(max_tiles, dtype=torch.int32))


def assert_routes_like_the_reference(top_k_index: torch.Tensor, num_experts: int, block_rows: int,
                                     real_tokens: int | None = None):
    real_tokens_on_device = None if real_tokens is None else torch.tensor([real_tokens], dtype=torch.int32)
    routed = serve_clef.route_to_row_tiles(top_k_index, num_experts, block_rows, real_tokens_on_device)
    expected = reference_row_tiles(top_k_index, num_experts, block_rows, real_tokens)
    for name, got, want in zip(("slot_pairs", "tile_experts", "tile_columns_done"), routed, expected, strict=True):
        assert got.dtype == torch.int32, name
        assert torch.equal(got, want), name


def router_choices(num_tokens: int, top_k: int, num_experts: int, seed: int) -> torch.Tensor:
    """[T, K] int64 as the router's topk gives them: K distinct experts per token."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(num_tokens, num_experts, generator=generator).topk(top_k, dim=-1).indices


@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 1), (1, 8), (512, 8)], ids=["S=1", "S=8", "S=4096"])
@pytest.mark.parametrize("block_rows", [16, 32, 64, 128])
def test_random_routings_of_128_experts(num_tokens, top_k, block_rows):
    assert_routes_like_the_reference(router_choices(num_tokens, top_k, 128, seed=num_tokens + block_rows), 128,
                                     block_rows)


def test_the_largest_routing_8192_tokens_top_8():
    """S = 65,536, the most pairs a batch sends: several chunks per block of pairs, ~15 s under the interpreter."""
    assert_routes_like_the_reference(router_choices(8192, 8, 128, seed=1), 128, 128)


def test_a_516_token_decision_leaves_a_short_last_block():
    """S = 4,128 is not a multiple of the pairs per block (64 here): the last block holds 32 pairs."""
    assert_routes_like_the_reference(router_choices(516, 8, 128, seed=2), 128, 64)


@pytest.mark.parametrize("expert", [0, 77, 127])
@pytest.mark.parametrize("block_rows", [16, 128])
def test_all_pairs_to_one_expert(expert, block_rows):
    """One expert owns every tile that holds pairs and the 127 others none: all min(E, S) = 128 spare tiles of the
    bound lie past the last, for the tile-filling programs to mark."""
    assert_routes_like_the_reference(torch.full((300, 4), expert), 128, block_rows)


def test_experts_without_pairs_between_experts_with_pairs():
    generator = torch.Generator().manual_seed(3)
    top_k_index = torch.tensor([3, 40, 41, 126])[torch.randint(0, 4, (250, 4), generator=generator)]
    assert_routes_like_the_reference(top_k_index, 128, 32)


@pytest.mark.parametrize("pairs_per_expert", [16, 17], ids=["whole tiles", "one pair over"])
def test_experts_that_fill_their_tiles_exactly_or_by_one_pair_over(pairs_per_expert):
    """No padding slot at all, then the most padding: each expert's last tile holds one pair."""
    generator = torch.Generator().manual_seed(pairs_per_expert)
    expert_of_pair = torch.arange(8).repeat_interleave(pairs_per_expert)
    top_k_index = expert_of_pair[torch.randperm(expert_of_pair.numel(), generator=generator)].reshape(-1, 1)
    assert_routes_like_the_reference(top_k_index, 8, 16)


def test_pairs_arriving_in_descending_expert_order_keep_their_order():
    """Experts descend with the pair index (the reverse of the sorted order), each over a run of 9 pairs, so a
    placement that reversed or interleaved pairs within an expert would show."""
    top_k_index = (127 - torch.arange(1024) // 9).reshape(128, 8)
    assert_routes_like_the_reference(top_k_index, 128, 32)


@pytest.mark.parametrize(("num_experts", "top_k", "block_rows"), [(1, 1, 16), (3, 2, 16), (4, 2, 32), (8, 2, 2)])
@pytest.mark.parametrize("num_tokens", [1, 5, 19, 300])
def test_tiny_models_few_experts(num_experts, top_k, num_tokens, block_rows):
    """E below the padded power of two (3), E = 1, and experts repeated within a token (the routing allows it)."""
    generator = torch.Generator().manual_seed(num_tokens * num_experts)
    top_k_index = torch.randint(0, num_experts, (num_tokens, top_k), generator=generator)
    assert_routes_like_the_reference(top_k_index, num_experts, block_rows)


@pytest.mark.parametrize("real_tokens", [517, 576, 1, 0], ids=["59 of padding", "none", "1 real", "no real"])
def test_the_padding_s_pairs_take_no_slot(real_tokens):
    """The engine's padding: a bucket of 576 tokens, its tokens from real_tokens on padding, routed (as the padding's
    tied router logits route it) to the same 8 experts. Their pairs take no slot."""
    top_k_index = router_choices(576, 8, 128, seed=5)
    top_k_index[real_tokens:] = torch.arange(8)
    assert_routes_like_the_reference(top_k_index, 128, 64, real_tokens)


def test_a_real_token_count_past_the_tokens_skips_nothing():
    top_k_index = router_choices(40, 4, 16, seed=6)
    assert_routes_like_the_reference(top_k_index, 16, 16, real_tokens=41)


@pytest.mark.parametrize(("num_tokens", "block_rows"), [(516, 64), (40, 16)])
def test_every_output_is_written_whatever_the_memory_held(monkeypatch, num_tokens, block_rows):
    """Fresh CPU memory is often zeros, which a routing that never wrote tile_columns_done (the counts the gluon
    down kernel waits on: a stale count lets it read a tile before gate_up wrote it) or a padding slot would pass
    unseen. Here every buffer the routing allocates starts as garbage: the outputs must still be the reference's."""
    allocate = torch.Tensor.new_empty

    def garbage(tensor, *size, **kwargs):
        return allocate(tensor, *size, **kwargs).fill_(0x5A5A5A5A if kwargs.get("dtype") == torch.int32 else 7)

    monkeypatch.setattr(torch.Tensor, "new_empty", garbage)
    assert_routes_like_the_reference(router_choices(num_tokens, 8, 128, seed=7), 128, block_rows)
