"""The HTTP server's scheduler: concurrent requests share forwards up to the token budget, the queue is bounded (503
with Retry-After), a request that waits past its deadline gets 503, and the request of a client that went away is
never scored. The device is held up by a forward that waits for the test, so that queues can be built on purpose."""

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import requests

import serve_clef
from test_http import (GOOD_REQUEST, SERVER_ARGS, TIMEOUT_S, args, check_error_body, loaded,  # noqa: F401 (fixtures)
                       metric_value, serve_in_thread, wait_until_ready)


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


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Until `condition()` holds; fails with `what` after TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def wait_until_queued(base_url: str, requests_queued: int) -> None:
    """Until the server holds this many requests (waiting or in a forward): what was sent so far has arrived."""
    wait_for(lambda: metric_value(requests.get(f"{base_url}/metrics", timeout=TIMEOUT_S).text,
                                  "serve_clef_queue_depth") >= requests_queued,
             f"{requests_queued} requests did not arrive")


def test_waiting_requests_share_one_forward_within_the_token_budget(loaded, monkeypatch):
    tokens = len(serve_clef.prepare(loaded, request_with_id(1), 2048).encoded.input_ids)
    with server_with_held_device(loaded, monkeypatch, "--max-batch-tokens", str(3 * tokens + 2)) as (base_url, held):
        with ThreadPoolExecutor(max_workers=8) as pool:
            first = pool.submit(post, base_url, request_with_id(0))
            assert held.started.acquire(timeout=TIMEOUT_S)  # r0 holds the device; the next seven queue behind it
            rest = [pool.submit(post, base_url, request_with_id(number)) for number in range(1, 8)]
            wait_until_queued(base_url, 8)  # all seven arrived
            time.sleep(1.0)  # and prepared, most of them, while r0 still holds the device
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
            wait_until_queued(base_url, 2)  # the second too: sent from the pool, it may arrive after the first starts
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


def test_requests_are_prepared_side_by_side_each_thread_with_a_processor_of_its_own(loaded, monkeypatch):
    """Two requests are prepared at once (the first two preparations wait for each other: prepared one after the
    other, the first would time out and its request get 500), and no two preparing threads share a tokenizer, whose
    Rust core refuses a call that changes its settings while another thread's call is inside it."""
    together = threading.Barrier(2, timeout=TIMEOUT_S / 4)
    calls = itertools.count()
    tokenizers = {}  # preparing thread: ids of the tokenizer cores it used
    prepare = serve_clef.prepare

    def recorded_prepare(thread_loaded, payload, *rest):
        tokenizer_core = thread_loaded.processor.tokenizer._tokenizer
        tokenizers.setdefault(threading.current_thread().name, set()).add(id(tokenizer_core))
        if next(calls) < 2:
            together.wait()
        return prepare(thread_loaded, payload, *rest)

    with server_with_held_device(loaded, monkeypatch) as (base_url, held):
        monkeypatch.setattr(serve_clef, "prepare", recorded_prepare)  # once loaded: the load's warm-ups are not counted
        held.go.set()
        with ThreadPoolExecutor(max_workers=8) as pool:
            responses = list(pool.map(lambda number: post(base_url, request_with_id(number)), range(8)))
    assert [response.status_code for response in responses] == [200] * 8
    assert sorted(record for batch in held.batches for record in batch) == sorted(f"r{n}" for n in range(8))
    assert len(tokenizers) >= 2 and all(len(cores) == 1 for cores in tokenizers.values())
    cores = [core for thread_cores in tokenizers.values() for core in thread_cores]
    assert len(set(cores)) == len(cores) and id(loaded.processor.tokenizer._tokenizer) not in cores


def test_each_preparing_thread_s_processor_is_warmed_at_load(loaded, monkeypatch):
    """What a processor computes on first use (the longest token's length, 0.1 s for a real vocabulary) is computed
    for every preparing thread's copy at load, not by the first request each thread prepares."""
    with server_with_held_device(loaded, monkeypatch) as (base_url, held):
        held.go.set()
        cache_misses = serve_clef.longest_token_chars.cache_info().misses
        with ThreadPoolExecutor(max_workers=8) as pool:
            responses = list(pool.map(lambda number: post(base_url, request_with_id(number)), range(8)))
    assert [response.status_code for response in responses] == [200] * 8
    assert serve_clef.longest_token_chars.cache_info().misses == cache_misses


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
    """While the device runs a forward, the host answers the records of the one before it: when more is waiting than
    one forward takes, the next forward goes to the device before the last one's records are answered."""
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
    # r0 answered after r1 was queued (r2 still waiting); r1 before r2 was queued (r2 alone fits in one forward)
    assert forwards_when_answered == {"r0": 2, "r1": 2, "r2": 3}


def test_what_fits_in_one_forward_waits_for_the_last_one_s_records_to_be_answered(loaded, monkeypatch):
    """When everything waiting fits in one forward, the running forward's records are answered before the next
    forward is queued, so that the requests their clients send next can still join it."""
    with server_with_held_device(loaded, monkeypatch) as (base_url, held):
        with answers_recorded(monkeypatch, held) as forwards_when_answered, ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(post, base_url, request_with_id(0))
            assert held.started.acquire(timeout=TIMEOUT_S)  # r0's forward holds the device
            second = pool.submit(post, base_url, request_with_id(1))
            time.sleep(1.0)  # r1 prepared and waiting
            held.go.set()
            responses = [first.result(), second.result()]
    assert all(response.status_code == 200 for response in responses)
    assert held.batches == [["r0"], ["r1"]]
    assert forwards_when_answered == {"r0": 1, "r1": 2}


def test_the_answered_clients_next_requests_join_the_forward_that_waits_for_them(loaded, monkeypatch):
    """After answering a forward while less than a forward's worth waits, the scorer gives the answered clients time
    to send again: a client answered by one forward and a request that waited through it share the next forward."""
    monkeypatch.setattr(serve_clef, "REJOIN_WAIT_S", TIMEOUT_S / 4)  # long enough for any machine's round trip
    with server_with_held_device(loaded, monkeypatch) as (base_url, held):
        with ThreadPoolExecutor(max_workers=2) as pool:
            client = pool.submit(lambda: [post(base_url, request_with_id(0)), post(base_url, request_with_id(2))])
            assert held.started.acquire(timeout=TIMEOUT_S)  # r0's forward holds the device
            waiting = pool.submit(post, base_url, request_with_id(1))
            time.sleep(1.0)  # r1 prepared and waiting
            held.go.set()
            responses = [*client.result(), waiting.result()]
    assert all(response.status_code == 200 for response in responses)
    assert held.batches == [["r0"], ["r1", "r2"]]


def test_a_lone_client_s_next_request_does_not_wait_to_be_joined(loaded, monkeypatch):
    """With nothing else waiting, a client's next request is scored as soon as it is prepared."""
    monkeypatch.setattr(serve_clef, "REJOIN_WAIT_S", TIMEOUT_S / 4)
    with server_with_held_device(loaded, monkeypatch) as (base_url, held):
        held.go.set()
        assert post(base_url, request_with_id(0)).status_code == 200
        started = time.perf_counter()
        assert post(base_url, request_with_id(1)).status_code == 200
        assert time.perf_counter() - started < TIMEOUT_S / 8
    assert held.batches == [["r0"], ["r1"]]


def test_a_forward_s_worth_waiting_is_not_held_for_the_answered_clients(loaded, monkeypatch):
    """The wait for the answered clients ends as soon as a forward's worth of tokens waits: r1, alone a whole
    forward under this budget, goes to the device as soon as r0 is answered."""
    monkeypatch.setattr(serve_clef, "REJOIN_WAIT_S", TIMEOUT_S / 4)
    tokens = len(serve_clef.prepare(loaded, request_with_id(1), 2048).encoded.input_ids)
    with server_with_held_device(loaded, monkeypatch, "--max-batch-tokens", str(tokens)) as (base_url, held):
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(post, base_url, request_with_id(0))
            assert held.started.acquire(timeout=TIMEOUT_S)  # r0's forward holds the device
            waiting = pool.submit(post, base_url, request_with_id(1))
            wait_until_queued(base_url, 2)
            time.sleep(1.0)  # r1 prepared and waiting
            released = time.perf_counter()
            held.go.set()
            assert waiting.result().status_code == 200 and first.result().status_code == 200
            assert time.perf_counter() - released < TIMEOUT_S / 8
    assert held.batches == [["r0"], ["r1"]]


class GatedEnds:
    """Stands in for the device's clock: each forward queued on the (CPU) model ends only when the test opens its
    gate, as a GPU forward ends after queue_forward has returned."""

    def __init__(self, monkeypatch):
        self.gates = []  # one threading.Event per forward, in the order queued
        self.all_open = False  # once the test is over: every forward, later ones too, ends at once
        queue_forward = serve_clef.queue_forward

        def gated_queue_forward(loaded, encoded_records):
            # the gate is listed once the forward has run on the CPU (its batch recorded by HeldForward), so that a
            # test which sees a forward's gate also sees its batch; opened if the test is over, checked after listing
            # it so that open_all, which sets all_open before it walks the list, cannot miss it
            host_logits = queue_forward(loaded, encoded_records).host_logits
            gate = threading.Event()
            self.gates.append(gate)
            if self.all_open:
                gate.set()
            return serve_clef.ForwardInFlight(host_logits, GatedEnd(gate))

        monkeypatch.setattr(serve_clef, "queue_forward", gated_queue_forward)

    def open_all(self) -> None:
        self.all_open = True
        for gate in self.gates:
            gate.set()


class GatedEnd:
    def __init__(self, gate: threading.Event):
        self.gate = gate

    def synchronize(self) -> None:
        assert self.gate.wait(TIMEOUT_S)


def test_two_groups_take_turns_on_the_device(loaded, monkeypatch):
    """A batch of two groups' worth on an idle device goes as two forwards, the second queued before the first's
    records are answered. Then the groups take turns: a group answered while the other's forward runs is queued as
    soon as its clients have sent again, before that forward ends; when fewer than a group sent again in time, the
    scorer waits for the running forward to end, and what came meanwhile takes its turn before that forward's records
    are answered."""
    monkeypatch.setattr(serve_clef, "ALTERNATING_RECORDS", 2)
    monkeypatch.setattr(serve_clef, "REJOIN_WAIT_S", 2.0)  # long enough for any machine's round trip
    with server_with_held_device(loaded, monkeypatch) as (base_url, held):
        held.go.set()  # forwards run at once on the CPU; they end when their gates open
        ends = GatedEnds(monkeypatch)
        with answers_recorded(monkeypatch, held) as forwards_when_answered, ThreadPoolExecutor(max_workers=8) as pool:
            try:
                sent = [pool.submit(post, base_url, request_with_id(0))]
                wait_for(lambda: len(ends.gates) == 1, "r0's forward was not queued")
                for number in range(1, 5):  # in this order
                    sent.append(pool.submit(post, base_url, request_with_id(number)))
                    wait_until_queued(base_url, number + 1)
                time.sleep(1.0)  # r1-r4 prepared and waiting: two groups' worth
                ends.gates[0].set()
                wait_for(lambda: len(ends.gates) == 3, "r1-r4 were not queued as two forwards")
                assert held.batches == [["r0"], ["r1", "r2"], ["r3", "r4"]]
                assert "r1" not in forwards_when_answered  # the second group was queued while the first still ran
                ends.gates[1].set()  # r1 and r2 answered while r3 and r4 run; their clients send again
                wait_for(lambda: {"r1", "r2"} <= set(forwards_when_answered), "r1 and r2 were not answered")
                for number in (5, 6):  # in this order
                    sent.append(pool.submit(post, base_url, request_with_id(number)))
                    wait_until_queued(base_url, number - 2)  # r3 and r4 in a forward, r5 (and r6) sent
                wait_for(lambda: len(ends.gates) == 4, "r5 and r6 were not queued while r3 and r4 ran")
                assert held.batches[3] == ["r5", "r6"] and not ends.gates[2].is_set()
                ends.gates[2].set()  # r3 and r4 answered; only one of their clients sends again in time
                wait_for(lambda: {"r3", "r4"} <= set(forwards_when_answered), "r3 and r4 were not answered")
                sent.append(pool.submit(post, base_url, request_with_id(7)))
                time.sleep(serve_clef.REJOIN_WAIT_S + 0.5)  # the wait for r3's and r4's clients is over
                sent.append(pool.submit(post, base_url, request_with_id(8)))
                wait_until_queued(base_url, 4)  # r7 and r8 waiting beside r5 and r6
                time.sleep(1.0)  # and prepared
                assert len(ends.gates) == 4 and "r5" not in forwards_when_answered  # waiting for r5's forward
                ends.gates[3].set()
                wait_for(lambda: len(ends.gates) == 5, "r7 and r8 were not queued")
            finally:
                ends.open_all()
            responses = [future.result() for future in sent]
    assert all(response.status_code == 200 for response in responses)
    assert held.batches == [["r0"], ["r1", "r2"], ["r3", "r4"], ["r5", "r6"], ["r7", "r8"]]
    # r5 and r6 were queued before r3 and r4 were answered, r7 and r8 before r5 and r6
    assert forwards_when_answered == {"r0": 1, "r1": 3, "r2": 3, "r3": 4, "r4": 4, "r5": 5, "r6": 5, "r7": 5,
                                      "r8": 5}


def test_a_device_fault_surfacing_in_a_forward_s_wait_gets_its_requests_500_and_the_scorer_goes_on(
        loaded, monkeypatch):
    """A fault of the device surfaces when the host waits for the forward (CUDA reports asynchronous faults there):
    the forward's requests get 500, and the next request is served."""
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
    assert len(faults) == 1  # r0's forward, waited for to answer it
