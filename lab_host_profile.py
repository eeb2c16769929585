"""Lab: the host time of queue_forward (returns before the device is done) for 1 and 16 ~500-token records on
synthetic:full, and a cProfile of it (Python functions by own time and by cumulative time)."""
import cProfile, io, pstats, statistics, sys, time
from pathlib import Path
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import torch
import serve_clef
from bench_serve import text_request

sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
loaded = serve_clef.load_clef(model=sys.argv[1] if len(sys.argv) > 1 else "synthetic:full")
tokenizer = loaded.processor.tokenizer
records = [serve_clef.prepare(loaded, text_request(tokenizer, 480 + 9 * i, 100 + i), 4096).encoded for i in range(16)]
for count in (1, 16):
    batch = records[:count]
    for _ in range(3):
        serve_clef.queue_forward(loaded, batch).wait()
    host_ms, whole_ms = [], []
    for _ in range(8):
        sync()
        start = time.perf_counter()
        flight = serve_clef.queue_forward(loaded, batch)
        host_ms.append((time.perf_counter() - start) * 1000)
        flight.wait()
        whole_ms.append((time.perf_counter() - start) * 1000)
    print(f"{count} records: queue_forward returns after {statistics.median(host_ms):.2f} ms (host), "
          f"the forward ends after {statistics.median(whole_ms):.2f} ms", flush=True)
    profile = cProfile.Profile()
    for _ in range(5):
        sync()
        profile.enable()
        flight = serve_clef.queue_forward(loaded, batch)
        profile.disable()
        flight.wait()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(40)
        print(f"--- {count} records, 5 calls, by {order}\n" + text.getvalue()[-9000:], flush=True)
