"""Lab (kept in history only): the routing's two kernels (count, place) timed with other launch settings, 48 layers' routings in
a CUDA graph, each setting's slots and tile experts checked equal to the served ones."""
import json, os, sys, itertools
from pathlib import Path
import torch, triton
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef as sc

def route(top_k_index, num_experts, block_rows, real_tokens, chunk, most_blocks, tiles, count_rows, warps_count, warps_place):
    expert_of_pair = top_k_index.reshape(-1)
    num_pairs = expert_of_pair.numel()
    max_tiles = -(-num_pairs // block_rows) + min(num_experts, num_pairs)
    padded_experts = triton.next_power_of_2(num_experts)
    block_pairs = chunk * max(1, triton.cdiv(num_pairs, most_blocks * chunk))
    num_blocks = triton.cdiv(num_pairs, block_pairs)
    routed_expert = expert_of_pair.new_empty(num_pairs, dtype=torch.int32)
    block_counts = expert_of_pair.new_empty(num_blocks, padded_experts, dtype=torch.int32)
    slot_pairs = expert_of_pair.new_empty(max_tiles * block_rows, dtype=torch.int32)
    tile_experts = expert_of_pair.new_empty(max_tiles, dtype=torch.int32)
    sc.count_pairs_per_expert_kernel[(num_blocks,)](
        expert_of_pair, real_tokens, routed_expert, block_counts, num_pairs, block_pairs,
        TOP_K=top_k_index.shape[1], PADDED=True, EXPERTS=padded_experts, CHUNK=chunk, num_warps=warps_count)
    sc.place_pairs_in_row_tiles_kernel[(num_blocks + triton.cdiv(max_tiles, tiles),)](
        routed_expert, block_counts, num_pairs, block_pairs, slot_pairs, tile_experts, num_blocks, num_experts,
        max_tiles, BLOCK_R=block_rows, COUNT_ROWS=count_rows, TILES=tiles, EXPERTS=padded_experts, CHUNK=chunk,
        num_warps=warps_place)
    return slot_pairs, tile_experts

SERVED = dict(chunk=64, most_blocks=128, tiles=16, count_rows=32, warps_count=8, warps_place=8)
VARIANTS = [("served", {})] + [
    (f"wp{wp} cr{cr} ch{ch} wc{wc}", dict(warps_place=wp, count_rows=cr, chunk=ch, warps_count=wc))
    for wp in (2, 4) for cr in (32, 64, 128) for ch in (64, 128) for wc in (4, 8)] + [("served again", {})]
results = {}
for tokens, block_rows in ((576, 64), (2048, 64), (8192, 128)):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    indices = [torch.randn(tokens, 128, device="cuda", generator=g).topk(8, dim=-1).indices for _ in range(48)]
    real = torch.tensor([tokens - 40], dtype=torch.int32, device="cuda")
    expected = [route(i, 128, block_rows, real, **SERVED) for i in indices]
    row = {}
    for name, change in VARIANTS:
        settings = {**SERVED, **change}
        got = [route(i, 128, block_rows, real, **settings) for i in indices]
        same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [route(i, 128, block_rows, real, **settings) for i in indices]
        graph.replay(); torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record(); graph.replay(); end.record(); end.synchronize(); times.append(start.elapsed_time(end))
        times.sort()
        row[name] = (round(times[10], 4), same)
        del graph, outs
    results[tokens] = row
    print(tokens, row, flush=True)
if os.environ.get("OUT"):
    json.dump(results, open(os.path.join(os.environ["OUT"], "lab_routing.json"), "w"), indent=1)
