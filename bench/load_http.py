"""Load test over HTTP on loopback: `serve_clef.py --model synthetic:full` in its own process, clients in this one.

At 1, 8, 16 and 64 concurrent clients, each client sends distinct ~512-token text requests (new content, new lengths,
as users send them) one after another on a keep-alive connection. 16 and 64 clients run twice: plain, and mixed,
where one client in eight sends its bodies slowly (in pieces, over ~0.3 s) and one in sixteen hangs up before its
answer. Meanwhile a probe reads /healthz every 50 ms. Reported per level: p50 and p95 latency, requests/s and
tokens/s of the answered requests, requests lost (sent by a client that waited, not answered 200), the records per
forward (from /metrics), the median of each stage the server reports in Server-Timing (queue, decode, encode,
forward, answer; plain clients only) and the /healthz latency under load.

Usage: python3 bench/load_http.py [--serve-clef FILE] [SERVER FLAGS...]   (writes $OUT/load_http.json when OUT is set)
       --serve-clef FILE: serve with another version of serve_clef.py (e.g. `git show REV:serve_clef.py > FILE`, kept
       in this tree's root, beside the decision module and synthetic release it imports), to compare two versions on
       one machine.
"""

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import joint_schema_model  # noqa: E402
import synthetic_release  # noqa: E402
from bench_serve import text_request  # noqa: E402

# (concurrent clients, requests sent in all, mixed): in a mixed level client i is slow if i % 8 == 7 and hangs up if
# i % 16 == 3. A slow client's requests take 0.3 s each to send, so a mixed level lasts as long as its slow clients'
# share, whatever the server's speed: its tokens/s measures robustness, the plain levels measure throughput.
LEVELS = [(1, 16, False), (8, 64, False), (16, 128, False), (16, 128, True), (64, 256, False), (64, 256, True)]
SLOW_EVERY, HANG_UP_EVERY = 8, 16
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def send_slowly(port: int, body: bytes) -> int:
    """POST the body in eight pieces over ~0.3 s; the status of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=600) as client:
        client.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                       b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        piece = -(-len(body) // 8)
        for start in range(0, len(body), piece):
            client.sendall(body[start:start + piece])
            time.sleep(0.04)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def hang_up(port: int, body: bytes) -> None:
    """POST the body and close the connection without reading the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as client:
        client.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.05)


def wait_until_ready(server: subprocess.Popen, port: int, seconds: float) -> None:
    """Until the server on `port` answers /healthz with 200 (its model loaded); fails if it exits or takes longer."""
    deadline = time.monotonic() + seconds
    while True:
        assert server.poll() is None, "the server exited while loading"
        assert time.monotonic() < deadline, "the server did not become ready"
        try:
            if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(1)


def batch_records(base_url: str) -> tuple[float, float]:
    """(forwards run, records scored) so far, from /metrics."""
    metrics = requests.get(f"{base_url}/metrics", timeout=30).text
    count = float(re.search(r"^serve_clef_batch_records_count (\S+)$", metrics, re.MULTILINE)[1])
    total = float(re.search(r"^serve_clef_batch_records_sum (\S+)$", metrics, re.MULTILINE)[1])
    return count, total


def run_level(port: int, clients: int, bodies: list[tuple[bytes, int]], mixed: bool) -> dict:
    base_url = f"http://127.0.0.1:{port}"
    latencies, tokens, lost, errors = [], 0, 0, []
    stages: dict[str, list[float]] = {}  # Server-Timing durations (ms) of the answered requests, per stage
    lock = threading.Lock()
    health_ms, probing = [], threading.Event()

    def probe_health():
        while not probing.is_set():
            start = time.perf_counter()
            requests.get(f"{base_url}/healthz", timeout=30)
            health_ms.append((time.perf_counter() - start) * 1000)
            time.sleep(0.05)

    def client(index: int):
        nonlocal tokens, lost
        session = requests.Session()
        for body, body_tokens in bodies[index::clients]:
            start = time.perf_counter()
            try:
                if mixed and index % HANG_UP_EVERY == 3:
                    hang_up(port, body)
                    continue
                if mixed and index % SLOW_EVERY == 7:
                    status = send_slowly(port, body)
                else:
                    response = session.post(f"{base_url}/v1/systemone", data=body, timeout=600,
                                            headers={"Content-Type": "application/json"})
                    status = response.status_code
                    timing = response.headers.get("Server-Timing", "")
                    with lock:
                        for stage, duration in re.findall(r"(\w+);dur=([\d.]+)", timing):
                            stages.setdefault(stage, []).append(float(duration))
            except (OSError, requests.RequestException) as error:
                status = repr(error)
            with lock:
                if status == 200:
                    latencies.append((time.perf_counter() - start) * 1000)
                    tokens += body_tokens
                else:
                    lost += 1
                    errors.append(status)

    forwards_before, records_before = batch_records(base_url)
    prober = threading.Thread(target=probe_health, daemon=True)
    prober.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(client, range(clients)))
    seconds = time.perf_counter() - start
    probing.set()
    prober.join()
    forwards_after, records_after = batch_records(base_url)
    latencies.sort()
    return {
        "clients": clients, "mixed": mixed, "requests": len(bodies), "answered": len(latencies), "lost": lost,
        "errors": sorted(set(map(str, errors)))[:5],
        "p50_ms": round(statistics.median(latencies), 1),
        "p95_ms": round(latencies[int(0.95 * (len(latencies) - 1))], 1),
        "requests_per_s": round(len(latencies) / seconds, 1), "tokens_per_s": round(tokens / seconds),
        "records_per_forward": round((records_after - records_before) / max(1, forwards_after - forwards_before), 2),
        "stages_p50_ms": {stage: round(statistics.median(values), 1) for stage, values in stages.items()},
        "healthz_p50_ms": round(statistics.median(health_ms), 1), "healthz_max_ms": round(max(health_ms), 1),
    }


def main() -> int:
    port = free_port()
    argv = sys.argv[1:]
    server_file = ROOT / "serve_clef.py"
    if argv[:1] == ["--serve-clef"]:
        server_file, argv = Path(argv[1]).resolve(), argv[2:]
    server_flags = ["--model", "synthetic:full", "--device", "cuda", *argv]
    log = open(Path(os.environ.get("OUT", tempfile.gettempdir()), "load_http_server.log"), "w")
    server = subprocess.Popen([sys.executable, str(server_file), *server_flags, "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=log)
    try:
        # the synthetic release's tokenizer, as the server builds it (written without weights)
        release_dir = synthetic_release.write_release(Path(tempfile.mkdtemp()) / "full", "full", weights=False)
        tokenizer = joint_schema_model.load_processor(release_dir).tokenizer
        wait_until_ready(server, port, 900)
        results = {"server": str(server_file), "server_flags": server_flags}
        seed = 0
        for clients, count, mixed in LEVELS:
            bodies = []
            for _ in range(count):
                seed += 1
                request = text_request(tokenizer, 500 + seed % 40, 10_000 + seed)
                body_tokens = len(joint_schema_model.encode_record(tokenizer, request).input_ids)
                bodies.append((json.dumps(request).encode(), body_tokens))
            level = f"{clients} clients" + (", mixed" if mixed else "")
            results[level] = run_level(port, clients, bodies, mixed)
            print(json.dumps(results[level]), flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "load_http.json").write_text(json.dumps(results, indent=2))
        levels = [result for level, result in results.items() if level not in ("server", "server_flags")]
        return 0 if all(level["lost"] == 0 for level in levels) else 1
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
