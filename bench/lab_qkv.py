"""Lab (kept in history only): the attention's q, k, v projections as three cuBLAS calls against one on their concatenated
weight, 48 layers of full-size random weights in a CUDA graph, at the token counts the engine runs."""
import json, os, torch
torch.manual_seed(0)
H, Q, KV, LAYERS = 2048, 4096, 512, 48
dev = "cuda"
fused = [torch.randn(Q + 2 * KV, H, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
parts = [w.split([Q, KV, KV]) for w in fused]
o_w = [torch.randn(H, Q, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
results = {}
for tokens in (64, 517, 576, 1024, 2048, 4096, 7957, 8192):
    x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
    def separate():
        return [torch.nn.functional.linear(x, w) for q_k_v in parts for w in q_k_v]
    def one():
        return [torch.nn.functional.linear(x, w) for w in fused]
    def o_only():
        a = torch.randn(tokens, Q, device=dev, dtype=torch.bfloat16)
        return [torch.nn.functional.linear(a, w) for w in o_w]
    row = {}
    for name, fn in (("separate", separate), ("fused", one), ("separate again", separate), ("fused again", one)):
        fn(); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
        g.replay(); torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record(); g.replay(); end.record(); end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        row[name] = round(times[len(times) // 2], 4)
        del g, out
    # exactness: the fused product's slices against the separate products
    sep = torch.cat([torch.nn.functional.linear(x, w) for w in parts[0]], -1)
    fus = torch.nn.functional.linear(x, fused[0])
    row["max_diff"] = (sep.float() - fus.float()).abs().max().item()
    row["bit_equal"] = bool(torch.equal(sep, fus))
    results[tokens] = row
    print(tokens, row, flush=True)
if os.environ.get("OUT"):
    json.dump(results, open(os.path.join(os.environ["OUT"], "lab_qkv.json"), "w"), indent=1)
