"""Lab (kept in history only): what one client's decision costs over HTTP beyond the stages the server reports in
Server-Timing, with the tiny synthetic model on CPU: 80 distinct ~500-token requests on one keep-alive connection,
alternately from `requests` and from a raw socket (the request bytes written at once, the response read to its
Content-Length), and /healthz from `requests`. Usage: python3 bench/lab_http_overhead.py SERVE_CLEF_FILE"""
import json, re, subprocess, sys, time, statistics, socket
ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "bench"))
import requests, joint_schema_model, synthetic_release, tempfile
from bench_serve import text_request
from pathlib import Path
port = 8766
server = subprocess.Popen([sys.executable, sys.argv[1], "--model", "synthetic", "--device", "cpu", "--port", str(port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
def raw_post(sock, body):
    head = (f"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(rest) < length:
        rest += sock.recv(65536)
    timing = re.search(rb"server-timing: ([^\r]*)", head, re.I).group(1).decode()
    return sum(float(v) for v in re.findall(r"dur=([\d.]+)", timing))
try:
    release_dir = synthetic_release.write_release(Path(tempfile.mkdtemp()) / "tiny", "tiny", weights=False)
    tok = joint_schema_model.load_processor(release_dir).tokenizer
    for _ in range(600):
        try:
            if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json().get("ready"): break
        except Exception: pass
        time.sleep(0.5)
    bodies = [json.dumps(text_request(tok, 500 + i, 100 + i)).encode() for i in range(80)]
    s = requests.Session()
    sock = socket.create_connection(("127.0.0.1", port)); sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    gaps = {"requests": [], "raw": []}
    for i, body in enumerate(bodies):
        t = time.perf_counter()
        if i % 2:
            r = s.post(f"http://127.0.0.1:{port}/v1/systemone", data=body, headers={"Content-Type": "application/json"})
            st = sum(float(v) for v in re.findall(r"dur=([\d.]+)", r.headers["Server-Timing"])); kind = "requests"
        else:
            st = raw_post(sock, body); kind = "raw"
        ms = (time.perf_counter() - t) * 1000
        if i >= 10: gaps[kind].append(ms - st)
    for k, v in gaps.items(): print(k, "gap p50", round(statistics.median(v), 3), "min", round(min(v), 3))
    hz = []
    for _ in range(50):
        t = time.perf_counter(); s.get(f"http://127.0.0.1:{port}/healthz"); hz.append((time.perf_counter() - t) * 1000)
    print("healthz via requests p50", round(statistics.median(hz), 3))
finally:
    server.terminate(); server.wait()
