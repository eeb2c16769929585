"""How long a text decision takes when it arrives just behind a video decision: with one preparing thread (the
scheduler before 2026-12-06) it waits for the video's decoding and encoding; with PREPARING_THREADS it is prepared
beside the video. Each setting is a server of its own (a process of this script, serve_clef's main with
PREPARING_THREADS set): the tiny synthetic model on CPU by default (any machine), or `--model synthetic:full` on a
GPU (loaded once per setting).

Per setting, eight trials of new requests (a ~512-token text of its own, a 4 s 320x240 video with sound of its own):
the text alone, then another text sent 5 ms after the video. Reported: the medians of the text's latency, ms.

Usage: python3 bench/text_behind_video.py [--model synthetic:full]   (writes $OUT/text_behind_video.json when OUT
       is set, the servers' logs to $OUT/text_behind_video_server.log)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_serve  # bench/
import load_http

import joint_schema_model  # the repository root
import serve_clef
import synthetic_release

TRIALS = 8
VIDEO = "video 4 s 320x240 + sound"


def text_latencies(port: int, texts_alone: list[dict], texts_behind: list[dict], videos: list[dict]) -> dict:
    def post(body: dict) -> float:
        started = time.perf_counter()
        response = requests.post(f"http://127.0.0.1:{port}/v1/systemone", json=body, timeout=600)
        assert response.status_code == 200, response.text
        return (time.perf_counter() - started) * 1000

    alone, behind = [], []
    for text_alone, text_behind, video in zip(texts_alone, texts_behind, videos):
        alone.append(post(text_alone))
        sender = threading.Thread(target=post, args=(video,))
        sender.start()
        time.sleep(0.005)
        behind.append(post(text_behind))
        sender.join()
    return {"text alone": round(statistics.median(alone), 1),
            "text 5 ms behind a video": round(statistics.median(behind), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic", help="synthetic (on CPU, the default) or synthetic:full")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process: its port
    parser.add_argument("--preparing-threads", type=int, help=argparse.SUPPRESS)  # and its PREPARING_THREADS
    args = parser.parse_args()
    server_flags = ["--model", args.model, "--api-key", "", *(["--device", "cpu"] if args.model == "synthetic" else [])]
    if args.serve:
        serve_clef.PREPARING_THREADS = args.preparing_threads
        return serve_clef.main([*server_flags, "--port", str(args.serve)])

    release = "full" if args.model == "synthetic:full" else "tiny"  # the tokenizer the server builds
    release_dir = synthetic_release.write_release(Path(tempfile.mkdtemp()) / release, release, weights=False)
    tokenizer = joint_schema_model.load_processor(release_dir).tokenizer
    seeds = iter(range(1, 1000))  # every request new: texts of their own lengths, videos of their own pixels and tones

    def new_texts(count: int) -> list[dict]:
        return [bench_serve.text_request(tokenizer, 512 + index, next(seeds)) for index in range(count)]

    results = {}
    log_path = Path(os.environ.get("OUT", tempfile.gettempdir()), "text_behind_video_server.log")
    for threads in (1, serve_clef.PREPARING_THREADS):
        port = load_http.free_port()
        with open(log_path, "a") as log:
            server = subprocess.Popen([sys.executable, __file__, "--model", args.model, "--serve", str(port),
                                       "--preparing-threads", str(threads)], stdout=subprocess.DEVNULL, stderr=log)
        try:
            load_http.wait_until_ready(server, port, 900)
            text_latencies(port, new_texts(1), new_texts(1),
                           [bench_serve.media_requests(next(seeds))[VIDEO]])  # a first round, not reported
            videos = [bench_serve.media_requests(next(seeds))[VIDEO] for _ in range(TRIALS)]
            name = f"{threads} preparing thread{'s' if threads > 1 else ''}"
            results[name] = text_latencies(port, new_texts(TRIALS), new_texts(TRIALS), videos)
        finally:
            server.terminate()
            server.wait(timeout=60)
        print(json.dumps({name: results[name]}), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "text_behind_video.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
