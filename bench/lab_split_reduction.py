"""Lab: the attention's output projection [T, 4096] x [4096, 2048] at small T, cuBLAS's one product against the
reduction split in S parts (one batched product into fp32, summed, rounded once). 48 layers' distinct weights in a
CUDA graph, medians of 20 replays; errors against an fp64 reference."""
import statistics, torch, json, os
torch.manual_seed(0)
dev = "cuda"
LAYERS, K, N = 48, 4096, 2048
weights = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64 for _ in range(LAYERS)]

def one(x, w):
    return torch.nn.functional.linear(x, w)

def split(parts):
    def run(x, w):
        T = x.shape[0]
        xs = x.view(T, parts, K // parts).transpose(0, 1)  # [S, T, K/S]
        ws = w.view(N, parts, K // parts).permute(1, 2, 0)  # [S, K/S, N]
        return torch.bmm(xs, ws, out_dtype=torch.float32).sum(0).to(torch.bfloat16)
    return run

def split_contig(parts):
    def run(x, w):
        T = x.shape[0]
        xs = x.view(T, parts, K // parts).transpose(0, 1)
        ws = w.view(N, parts, K // parts).transpose(0, 1)  # [S, N, K/S]
        return torch.bmm(xs, ws.transpose(1, 2), out_dtype=torch.float32).sum(0).to(torch.bfloat16)
    return run

def compiled_split(parts):
    fn = torch.compile(split(parts), dynamic=True)
    return fn

variants = {"one": one, "split2": split(2), "split4": split(4), "split8": split(8), "split2c": split_contig(2),
            "compiled_split4": compiled_split(4), "compiled_one": torch.compile(one, dynamic=True)}
results = {}
for T in (64, 320, 576, 1088, 1536, 2048, 4096):
    xs = [torch.randn(T, K, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    ref = (xs[0].double() @ weights[0].double().T)
    row = {}
    for name, fn in variants.items():
        try:
            out = fn(xs[0], weights[0])
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for l in range(LAYERS): fn(xs[l], weights[l])
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for l in range(LAYERS): fn(xs[l], weights[l])
            times = []
            for _ in range(20):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); g.replay(); b.record(); b.synchronize(); times.append(a.elapsed_time(b))
            row[name] = (round(statistics.median(times), 3), f"{err:.2e}")
        except Exception as e:
            row[name] = f"{type(e).__name__}: {str(e)[:100]}"
    results[T] = row
    print(T, row, flush=True)
if os.environ.get("OUT"):
    json.dump(results, open(os.path.join(os.environ["OUT"], "split_reduction.json"), "w"), indent=1)
