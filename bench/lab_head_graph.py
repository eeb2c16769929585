"""Lab (GPU): what the batched joint head costs a forward, launched op by op as served and replayed from one CUDA graph
of the same call, so that we know what capturing the head would save before building it.

The full-size head (hidden 2048, width 1024, 2 routing and 4 decoder layers, 16 heads; random weights from the
synthetic release's recipe) on random hidden states of 1, 4 and 16 records of ~512 tokens with three questions of
2-5 options (bench_serve's), the output embeddings in pinned host memory as served. Per batch: the device time of one
call op by op (CUDA events, the host launching as it goes), the host's time to queue it, the kernels and their summed
time (torch.profiler), and the device time of the same call replayed from a CUDA graph (the head's index built
before the capture, as a graph needs fixed inputs). Outputs of the eager call and the replay are compared bit for bit.

Usage (GPU): python3 bench/lab_head_graph.py   (writes $OUT/lab_head_graph.json when OUT is set)
"""

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_serve  # noqa: E402  (bench/: the questions and the text requests)
import joint_schema_model  # noqa: E402
import serve_clef  # noqa: E402
import synthetic_release  # noqa: E402

RECORD_COUNTS = (1, 4, 16)
REPEATS = 20


def device_ms(function) -> float:
    """Median device time of `function` between CUDA events, each call after the device has idled."""
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    from transformers import AutoTokenizer

    release = synthetic_release.write_release(tempfile.mkdtemp(), size="full", weights=False)
    tokenizer = AutoTokenizer.from_pretrained(release)
    head_config = json.loads((release / "joint_head_config.json").read_text())
    head = joint_schema_model.JointSchemaHead(**head_config)
    head.load_state_dict(serve_clef.safetensors.torch.load_file(release / "joint_head.safetensors"))
    head = head.to("cuda", torch.bfloat16).eval()
    batched = serve_clef.BatchedJointSchemaHead(head)
    hidden = head_config["hidden_size"]
    vocabulary = 152_064
    table = (torch.randn(vocabulary, hidden) * 0.02).to(torch.bfloat16).pin_memory()  # [V, H], as HostEmbedding keeps
    report = {"gpu": torch.cuda.get_device_name(), "rows": []}
    failures = 0
    for records in RECORD_COUNTS:
        encoded = [joint_schema_model.encode_record(tokenizer, bench_serve.text_request(tokenizer, 512 + 7 * i, i))
                   for i in range(records)]
        length = max(len(record.input_ids) for record in encoded)
        input_ids = torch.zeros(records, length, dtype=torch.long)
        attention_mask = torch.zeros(records, length, dtype=torch.long)
        for b, record in enumerate(encoded):
            input_ids[b, :len(record.input_ids)] = torch.tensor(record.input_ids)
            attention_mask[b, :len(record.input_ids)] = 1
        generator = torch.Generator("cuda").manual_seed(records)
        hidden_states = torch.randn(records, length, hidden, device="cuda", generator=generator).to(torch.bfloat16)
        arguments = (hidden_states, input_ids.cuda(), attention_mask.cuda(), encoded, table)

        def call():
            return batched(*arguments)

        with torch.inference_mode():
            eager = call()
            eager_ms = device_ms(call)
            host = []
            for _ in range(REPEATS):
                torch.cuda.synchronize()
                start = time.perf_counter()
                call()
                host.append((time.perf_counter() - start) * 1000)
                torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                call()
                torch.cuda.synchronize()
            # as bench/profile_forward.py counts them: the device's events and their own time
            kernels = [event for event in profile.key_averages()
                       if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total]
            busy_ms = sum(event.self_device_time_total for event in kernels) / 1000
            # the same call from a graph: its index made once, before the capture (a graph replays fixed inputs)
            host_index = serve_clef.joint_head_index(encoded, length)
            device_index = host_index.to(torch.device("cuda"))
            saved = serve_clef.joint_head_index, serve_clef.JointHeadIndex.to
            serve_clef.joint_head_index = lambda records_, length_: host_index
            serve_clef.JointHeadIndex.to = lambda self, device: device_index
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    call()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = call()
                graph.replay()
                torch.cuda.synchronize()
                equal = all(torch.equal(a, b) for first, second in zip(eager, captured) for a, b in zip(first, second))
                graph_ms = device_ms(graph.replay)
                graph_error = None
            except RuntimeError as error:  # something in the head cannot be captured: say what
                equal, graph_ms, graph_error = False, None, f"{type(error).__name__}: {error}"
            finally:
                serve_clef.joint_head_index, serve_clef.JointHeadIndex.to = saved
        failures += not equal
        row = {"records": records, "tokens": int(attention_mask.sum()), "eager_device_ms": eager_ms,
               "eager_host_ms": statistics.median(host), "kernels": sum(event.count for event in kernels),
               "kernel_busy_ms": busy_ms, "graph_device_ms": graph_ms, "graph_equal": equal, "graph_error": graph_error}
        report["rows"].append(row)
        print(f"{records:2} records ({row['tokens']} tokens): op by op {eager_ms:.3f} ms on the device, "
              f"{row['eager_host_ms']:.2f} ms of host to queue, {row['kernels']} kernels busy {busy_ms:.3f} ms; "
              + (f"graph {graph_ms:.3f} ms, bit-equal {equal}" if graph_error is None else f"graph: {graph_error}"),
              flush=True)
    if out_dir := os.environ.get("OUT"):
        Path(out_dir, "lab_head_graph.json").write_text(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
