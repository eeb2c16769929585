"""The HTTP server's scheduler: concurrent requests share forwards up to the token budget, the queue is bounded (503
with Retry-After), a request that waits past its deadline gets 503, and the request of a client that went away is
never scored; the next forward is queued before the last one is answered, ahead of the running one's foreseen end.
The device is held up by a forward that waits for the test, so that queues can be built on purpose, or modeled (a
forward of fixed device time, its end on the host's clock)."""

import contextlib
import itertools
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import requests

import serve_clef
from test_http import (GOOD_REQUEST, SERVER_ARGS, TIMEOUT_S, args, check_error_body, loaded,  # noqa: F401 (fixtures)
                       metric_value, serve_in_thread, wait_until_ready)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from host_capacity import ModeledEnd  # noqa: E402  (the capacity bench's modeled device, whose clock is the host's)


def server_args(*flags: str):
    return serve_clef.parse_args([*SERVER_ARGS, "--api-key", "", *flags])


class HeldForward:
    """Stands in for the model's batch forward: records the records of each batch, and holds a forward until the
    test lets it go."""

    def __init__(self, loaded, monkeypatch):
        self.forward = loaded.model._forward_unpadded
        self.batches = []  # record ids of each forward
        self.started = threading.Semaphore(0)
        self.go = threading.Event()
        self.go.set()
        monkeypatch.setattr(loaded.model, "_forward_unpadded", self)

    def __call__(self, batch):
        self.batches.append([record.record_id for record in batch["records"]])
        self.started.release()
        assert self.go.wait(TIMEOUT_S)
        return self.forward(batch)


@contextlib.contextmanager
def server_with_held_device(loaded, monkeypatch, *flags: str):
    """(base URL, HeldForward) of an in-process server on the tiny model, its next forward held until `held.go`."""
    held = HeldForward(loaded, monkeypatch)
    with serve_in_thread(serve_clef.create_app(server_args(*flags), load=lambda args, progress: loaded)) as base_url:
        wait_until_ready(base_url, limit_s=TIMEOUT_S)
        held.go.clear()
        yield base_url, held


def request_with_id(number: int) -> dict:
    return {**GOOD_REQUEST, "id": f"r{number}", "state": f"ticket {number}: the parcel arrived {number} days late"}


def post(base_url: str, body: dict) -> requests.Response:
    return requests.post(f"{base_url}/v1/systemone", json=body, timeout=TIMEOUT_S)


def wait_until_queued(base_url: str, requests_queued: int) -> None:
    """Until the server holds this many requests (waiting or in a forward): what was sent so far has arrived."""
    deadline = time.monotonic() + TIMEOUT_S
    while metric_value(requests.get(f"{base_url}/metrics", timeout=TIMEOUT_S).text,
                       "serve_clef_queue_depth") < requests_queued:
        assert time.monotonic() < deadline, f"{requests_queued} requests did not arrive"
        time.sleep(0.02)


def test_waiting_requests_share_one_forward_within_the_token_budget(loaded, monkeypatch):
    tokens = len(serve_clef.prepare(loaded, request_with_id(1), 2048).encoded.input_ids)
    with server_with_held_device(loaded, monkeypatch, "--max-batch-tokens", str(3 * tokens + 2)) as (base_url, held):
        with ThreadPoolExecutor(max_workers=8) as pool:
            first = pool.submit(post, base_url, request_with_id(0))
            assert held.started.acquire(timeout=TIMEOUT_S)  # r0 holds the device; the next seven queue behind it
            rest = [pool.submit(post, base_url, request_with_id(number)) for number in range(1, 8)]
            time.sleep(1.0)  # most of the seven prepared and waiting
            held.go.set()
            responses = [first.result(), *(future.result() for future in rest)]
    assert all(response.status_code == 200 for response in responses)
    assert held.batches[0] == ["r0"]
    # the waiting seven, none lost or repeated, several per forward but never more than the budget's three
    assert sorted(record for batch in held.batches[1:] for record in batch) == [f"r{n}" for n in range(1, 8)]
    assert max(len(batch) for batch in held.batches[1:]) == 3


def test_a_full_queue_gets_503_with_retry_after(loaded, monkeypatch):
    with server_with_held_device(loaded, monkeypatch, "--max-queue", "2") as (base_url, held):
        with ThreadPoolExecutor(max_workers=2) as pool:
            queued = [pool.submit(post, base_url, request_with_id(number)) for number in range(2)]
            assert held.started.acquire(timeout=TIMEOUT_S)
            refused = post(base_url, request_with_id(2))
            held.go.set()
            assert all(future.result().status_code == 200 for future in queued)
        body = check_error_body(refused, 503, "--max-queue")
        assert body["detail"]["error_type"] == "overloaded"
        assert refused.headers["Retry-After"].isdigit()
        assert post(base_url, request_with_id(3)).status_code == 200  # the slots came back


def test_a_request_past_its_deadline_gets_503_and_is_not_scored(loaded, monkeypatch):
    with server_with_held_device(loaded, monkeypatch, "--request-timeout", "1") as (base_url, held):
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(post, base_url, request_with_id(0))
            assert held.started.acquire(timeout=TIMEOUT_S)
            late = pool.submit(post, base_url, request_with_id(1))
            time.sleep(2.5)  # r1 waits past its 1 s deadline behind r0
            held.go.set()
            assert first.result().status_code == 200
            body = check_error_body(late.result(), 503, "--request-timeout")
    assert late.result().headers["Retry-After"].isdigit() and body["detail"]["error_type"] == "overloaded"
    assert held.batches == [["r0"]]


def test_the_request_of_a_client_that_went_away_is_not_scored(loaded, monkeypatch):
    with server_with_held_device(loaded, monkeypatch) as (base_url, held):
        with ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(post, base_url, request_with_id(0))
            assert held.started.acquire(timeout=TIMEOUT_S)
            body = requests.models.complexjson.dumps(request_with_id(1)).encode()
            address = urlsplit(base_url)
            with socket.create_connection((address.hostname, address.port)) as client:  # sends r1, then hangs up
                client.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                time.sleep(0.5)
            time.sleep(2 * serve_clef.DISCONNECT_CHECK_S + 0.5)  # the server notices the hang-up
            held.go.set()
            assert first.result().status_code == 200
        assert post(base_url, request_with_id(2)).status_code == 200
    assert held.batches == [["r0"], ["r2"]]


@contextlib.contextmanager
def answers_recorded(monkeypatch, held):
    """{record id: forwards queued by the time the record was answered}, filled while the block runs."""
    forwards_when_answered = {}
    answer = serve_clef.answer

    def recorded_answer(loaded, prepared, logits):
        forwards_when_answered[prepared.encoded.record_id] = len(held.batches)
        return answer(loaded, prepared, logits)

    monkeypatch.setattr(serve_clef, "answer", recorded_answer)
    yield forwards_when_answered


def test_the_next_forward_is_queued_before_the_last_one_s_records_are_answered(loaded, monkeypatch):
    """While the device runs a forward, the host answers the records of the one before it: the next forward goes to
    the device before the last one's records are answered, at once when more is waiting than one forward takes."""
    tokens = len(serve_clef.prepare(loaded, request_with_id(1), 2048).encoded.input_ids)
    with server_with_held_device(loaded, monkeypatch, "--max-batch-tokens", str(tokens + 2)) as (base_url, held):
        with answers_recorded(monkeypatch, held) as forwards_when_answered, ThreadPoolExecutor(max_workers=3) as pool:
            first = pool.submit(post, base_url, request_with_id(0))
            assert held.started.acquire(timeout=TIMEOUT_S)  # r0's forward holds the device
            rest = []
            for number in (1, 2):  # r1 arrives before r2
                rest.append(pool.submit(post, base_url, request_with_id(number)))
                wait_until_queued(base_url, number + 1)
            time.sleep(1.0)  # r1 and r2 prepared and waiting: two forwards' worth under this budget
            held.go.set()
            responses = [first.result(), *(future.result() for future in rest)]
    assert all(response.status_code == 200 for response in responses)
    assert held.batches == [["r0"], ["r1"], ["r2"]]
    # each forward's records answered once the next forward was queued (r2's: none came after it)
    assert forwards_when_answered == {"r0": 2, "r1": 3, "r2": 3}


class HeldWait:
    """Stands in for the engine's queue_forward: queues the forward as it does, but the forward's wait() holds until
    the test lets it go, as if the device were still running it; records the records of each forward."""

    def __init__(self, monkeypatch):
        self.queue_forward = serve_clef.queue_forward
        self.batches = []
        self.waiting = threading.Semaphore(0)  # released when the scorer starts waiting for a held forward
        self.go = threading.Event()
        monkeypatch.setattr(serve_clef, "queue_forward", self)

    def __call__(self, loaded, encoded_records):
        self.batches.append([record.record_id for record in encoded_records])
        flight = self.queue_forward(loaded, encoded_records)
        held = self

        class HeldFlight(serve_clef.ForwardInFlight):
            def wait(self):
                held.waiting.release()
                assert held.go.wait(TIMEOUT_S)
                return super().wait()

            def done(self):
                return held.go.is_set() and super().done()

        return HeldFlight(flight.host_logits, flight.end_event)


def test_what_arrives_while_a_forward_runs_joins_the_next_forward(loaded, monkeypatch):
    """When everything waiting fits in one forward, the scorer lets the running forward finish before it queues the
    next: requests that arrive while the device runs it all join the next forward, which is queued before the
    running one's records are answered."""
    held = HeldWait(monkeypatch)
    with serve_in_thread(serve_clef.create_app(server_args(), load=lambda args, progress: loaded)) as base_url:
        wait_until_ready(base_url, limit_s=TIMEOUT_S)
        held.batches.clear()  # the load's own forwards, if any
        with answers_recorded(monkeypatch, held) as forwards_when_answered, ThreadPoolExecutor(max_workers=3) as pool:
            first = pool.submit(post, base_url, request_with_id(0))
            assert held.waiting.acquire(timeout=TIMEOUT_S)  # r0 queued; the scorer waits for the device to run it
            rest = []
            for number in (1, 2):
                rest.append(pool.submit(post, base_url, request_with_id(number)))
                wait_until_queued(base_url, number + 1)
            time.sleep(1.0)  # r1 and r2 prepared and waiting
            held.go.set()
            responses = [first.result(), *(future.result() for future in rest)]
    assert all(response.status_code == 200 for response in responses)
    assert held.batches == [["r0"], ["r1", "r2"]]
    assert forwards_when_answered == {"r0": 2, "r1": 2, "r2": 2}


def test_a_lone_client_s_next_request_is_scored_at_once(loaded, monkeypatch):
    """With nothing else waiting, a client's next request is scored as soon as it is prepared."""
    with server_with_held_device(loaded, monkeypatch) as (base_url, held):
        held.go.set()
        assert post(base_url, request_with_id(0)).status_code == 200
        started = time.perf_counter()
        assert post(base_url, request_with_id(1)).status_code == 200
        assert time.perf_counter() - started < TIMEOUT_S / 8
    assert held.batches == [["r0"], ["r1"]]


def test_a_device_fault_surfacing_in_a_forward_s_wait_gets_its_requests_500_and_the_scorer_goes_on(
        loaded, monkeypatch):
    """A fault of the device surfaces when the host waits for the forward (CUDA reports asynchronous faults there,
    and again on every later wait). The scorer waits for a running forward before queueing what fits in one, and
    again to answer it: the forward's requests get 500, and the next request is served."""
    queue_forward = serve_clef.queue_forward
    faults = []

    class FaultyFlight(serve_clef.ForwardInFlight):
        def wait(self):
            faults.append(self.host_logits)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def faulty_queue_forward(loaded, encoded_records):
        flight = queue_forward(loaded, encoded_records)
        if faults:
            return flight
        return FaultyFlight(flight.host_logits, flight.end_event)

    with serve_in_thread(serve_clef.create_app(server_args(), load=lambda args, progress: loaded)) as base_url:
        wait_until_ready(base_url, limit_s=TIMEOUT_S)
        monkeypatch.setattr(serve_clef, "queue_forward", faulty_queue_forward)
        response = post(base_url, request_with_id(0))
        check_error_body(response, 500, "internal error")
        assert post(base_url, request_with_id(1)).status_code == 200
    assert len(faults) >= 2  # r0's forward waited for before queueing what came next, and again to answer r0


def test_once_forwards_have_run_the_next_one_is_queued_before_the_running_one_ends(loaded, monkeypatch):
    """Two clients, each sending its next request once answered, on a modeled device that takes 0.2 s a forward and
    runs one at a time: after three forwards the scorer foresees when the running forward ends, and queues the next
    one (the other client's request) before that, so that the device need not wait for the host to queue it. Every
    request is answered as on a device of no delay."""
    # forwards: (when the host began to queue it, when the modeled device ends it)
    device_s, queue_forward, forwards = 0.2, serve_clef.queue_forward, []

    def modeled_queue_forward(loaded, encoded_records):
        began = time.perf_counter()
        flight = queue_forward(loaded, encoded_records)  # the host's work (on the CPU, the whole forward)
        queued, device_free = time.perf_counter(), forwards[-1][1] if forwards else 0.0
        forwards.append((began, max(queued, device_free) + device_s))
        return serve_clef.ForwardInFlight(flight.host_logits, ModeledEnd(forwards[-1][1]))

    requests_of = {client: [request_with_id(10 * client + n) for n in range(6)] for client in (1, 2)}
    expected = [serve_clef.decide(loaded, body)["answers"] for bodies in requests_of.values() for body in bodies]
    with serve_in_thread(serve_clef.create_app(server_args(), load=lambda args, progress: loaded)) as base_url:
        wait_until_ready(base_url, limit_s=TIMEOUT_S)
        monkeypatch.setattr(serve_clef, "queue_forward", modeled_queue_forward)
        with ThreadPoolExecutor(max_workers=2) as pool:
            answered = [response for client in pool.map(
                lambda bodies: [post(base_url, body) for body in bodies], requests_of.values()) for response in client]
    assert all(response.status_code == 200 for response in answered)
    assert [response.json()["answers"] for response in answered] == expected  # client after client, in order
    begun_before_the_last_ended = [began < previous_end - 0.003
                                   for (_, previous_end), (began, _) in itertools.pairwise(forwards)]
    assert not any(begun_before_the_last_ended[:2])  # the first forwards: no forecast yet
    assert any(begun_before_the_last_ended[3:])


def test_the_device_forecast_is_the_weighted_least_squares_line():
    # the reference: numpy's least-squares fit, each forward weighted by FADE to the power of the forwards run since
    rng = np.random.default_rng(0)
    tokens = rng.integers(300, 9000, size=40)
    seconds = 0.0105 + 16.2e-6 * tokens + rng.normal(0, 0.002, size=40)
    forecast = serve_clef.DeviceForecast()
    assert forecast.device_seconds(500) is None
    for count, (forward_tokens, forward_seconds) in enumerate(zip(tokens, seconds), start=1):
        forecast.ran(int(forward_tokens), float(forward_seconds))
        if count < 3:
            assert forecast.device_seconds(500) is None  # too few forwards to foresee one
            continue
        weights = serve_clef.DeviceForecast.FADE ** np.arange(count - 1, -1, -1)
        slope, intercept = np.polyfit(tokens[:count], seconds[:count], 1, w=np.sqrt(weights))
        for asked in (64, 4000, 8192):
            assert forecast.device_seconds(asked) == pytest.approx(max(0.0, intercept + slope * asked), rel=1e-6)
