"""Lab: the scheduler's turns on the GPU, one server per tree in turn (argv: the trees' roots), each with passes of
16 clients (256 distinct ~512-token requests), 8 clients (128) and 1 client (40); every request new.
Run on 2026-12-06 from the repository root (as lab_turns.py there) with `base . base`, base/ holding 4a83215's files
and the working tree branch lab/rejoin-since-answers."""
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

PASSES = [(16, 256), (8, 128), (16, 256), (1, 40), (16, 256), (8, 128), (16, 256)]
release_dir = synthetic_release.write_release(Path(tempfile.mkdtemp()) / "full", "full", weights=False)
tokenizer = joint_schema_model.load_processor(release_dir).tokenizer
results, seed = {}, 0
for index, root in enumerate(sys.argv[1:]):
    port = load_http.free_port()
    log = open(Path(os.environ.get("OUT", tempfile.gettempdir()), f"lab_turns_server_{index}.log"), "w")
    server = subprocess.Popen([sys.executable, str(Path(root) / "serve_clef.py"), "--model", "synthetic:full",
                               "--device", "cuda", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log)
    rows = results[f"{index}: {root}"] = []
    try:
        load_http.wait_until_ready(server, port, 900)
        for clients, count in PASSES:
            bodies = []
            for _ in range(count):
                seed += 1
                request = text_request(tokenizer, 500 + seed % 40, 30_000 + seed)
                bodies.append((json.dumps(request).encode(),
                               len(joint_schema_model.encode_record(tokenizer, request).input_ids)))
            level = load_http.run_level(port, clients, bodies, mixed=False)
            rows.append(level)
            print(root, json.dumps({key: level[key] for key in ("clients", "p50_ms", "p95_ms", "tokens_per_s", "lost",
                                                                "records_per_forward")}), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "lab_turns.json").write_text(json.dumps(results, indent=1))
