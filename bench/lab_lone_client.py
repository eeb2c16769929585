"""Lab (kept in history only): does one client's latency drift over a server's life? One server
(synthetic:full on the GPU), one-client passes of 80 distinct ~512-token requests alternating with 16-client passes
of 256, every request new; each pass's p50 / p95 and Server-Timing medians."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import joint_schema_model  # noqa: E402
import load_http  # noqa: E402
import synthetic_release  # noqa: E402
from bench_serve import text_request  # noqa: E402

PASSES = [(1, 80), (16, 256), (1, 80), (16, 256), (1, 80), (16, 256), (1, 80)]

port = load_http.free_port()
log = open(Path(os.environ.get("OUT", tempfile.gettempdir()), "lab_lone_client_server.log"), "w")
server = subprocess.Popen([sys.executable, str(load_http.ROOT / "serve_clef.py"), "--model", "synthetic:full",
                           "--device", "cuda", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log)
results = []
try:
    release_dir = synthetic_release.write_release(Path(tempfile.mkdtemp()) / "full", "full", weights=False)
    tokenizer = joint_schema_model.load_processor(release_dir).tokenizer
    load_http.wait_until_ready(server, port, 900)
    seed = 0
    for clients, count in PASSES:
        bodies = []
        for _ in range(count):
            seed += 1
            request = text_request(tokenizer, 500 + seed % 40, 20_000 + seed)
            bodies.append((json.dumps(request).encode(),
                           len(joint_schema_model.encode_record(tokenizer, request).input_ids)))
        level = load_http.run_level(port, clients, bodies, mixed=False)
        results.append(level)
        print(json.dumps({key: level[key] for key in ("clients", "p50_ms", "p95_ms", "tokens_per_s", "lost",
                                                      "records_per_forward", "stages_p50_ms")}), flush=True)
finally:
    server.terminate()
    server.wait(timeout=60)
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "lab_lone_client.json").write_text(json.dumps(results, indent=1))
