"""serve_clef's BatchedJointSchemaHead against the decision module's JointSchemaHead (joint_schema_model.py), the
reference: the same logits from random heads and hidden states in FP32 (to float rounding) and BF16 (to BF16 noise),
padding that changes nothing, a number of operations that does not grow with the batch, and the load-time check that
installs it only over a head whose logits it reproduces."""

import json
import random
import types

import pytest
import requests
import torch
from torch.overrides import TorchFunctionMode

import joint_schema_model as jsm
import serve_clef
from test_engine import ANSWER_NOISE, largest_difference
from test_engine import REQUESTS as ENGINE_REQUESTS
from test_http import SERVER_ARGS, TIMEOUT_S, serve_in_thread, wait_until_ready

CONFIG = {"hidden_size": 48, "width": 32, "routing_layers": 2, "layers": 2, "heads": 4, "feedforward": 64}
VOCABULARY = 100
# FP32: the batched head sums in another order (segment means, padded attention), so float rounding only.
FP32_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
# BF16: the batch changes the shapes, so the summation order, of every matrix product and attention, and each of the
# head's steps rounds to 8 significant bits. Measured over 8 random heads: the two heads' logits differ by at most
# 1.8% of the largest logit, and each is as far from the FP32 logits as the other (within a factor 1.4).
BF16_TOLERANCE = 0.03  # of the largest logit's magnitude
BF16_ERROR_FACTOR = 2.0  # the batched head's distance to the FP32 logits, at most this times the reference head's


def random_head(seed: int) -> jsm.JointSchemaHead:
    """A JointSchemaHead with every parameter random (its scalars too, so that no term is switched off)."""
    torch.manual_seed(seed)
    head = jsm.JointSchemaHead(**CONFIG).eval()
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
        head.prior_logit_scale.fill_(1.5)
        head.joint_logit_scale.fill_(2.0)
        head.residual_gate.fill_(0.3)
    return head


def random_record(rng: random.Random, record_id: str, option_counts: list[int]) -> jsm.EncodedRecord:
    """A record with one question per entry of option_counts (random types), spans of 1-6 tokens with gaps between
    them, and a few tokens after the last span."""
    position, questions = rng.randint(2, 12), []
    for k, option_count in enumerate(option_counts):
        question_length = rng.randint(1, 5)
        question_span = (position, position + question_length)
        position += question_length + rng.randint(1, 3)
        option_spans = []
        for _ in range(option_count):
            option_length = rng.randint(1, 6)
            option_spans.append((position, position + option_length))
            position += option_length + rng.randint(0, 2)
        questions.append(jsm.EncodedQuestion(f"q{k}", rng.randrange(3), question_span, tuple(option_spans),
                                             tuple(str(j) for j in range(option_count))))
    input_ids = tuple(rng.randrange(VOCABULARY) for _ in range(position + rng.randint(1, 20)))
    return jsm.EncodedRecord(input_ids=input_ids, questions=tuple(questions), record_id=record_id)


def random_records(seed: int) -> list[jsm.EncodedRecord]:
    """Five records of different lengths and question counts; one question has a single option."""
    rng = random.Random(seed)
    shapes = [[2, 3], [1], [5, 2, 4, 2], [3, 3, 2], [2]]
    return [random_record(rng, f"r{index}", option_counts) for index, option_counts in enumerate(shapes)]


def head_inputs(records: list, seed: int, dtype=torch.float32) -> tuple:
    """The head's arguments for records right-padded into one batch: random hidden states (large in the padding, so
    that any leak shows), ids, mask and an output embedding table."""
    generator = torch.Generator().manual_seed(seed)
    length = max(len(record.input_ids) for record in records)
    hidden_states = 2 * torch.randn(len(records), length, CONFIG["hidden_size"], generator=generator)  # [B, L, H]
    input_ids = torch.randint(VOCABULARY, (len(records), length), generator=generator)  # [B, L]
    attention_mask = torch.zeros(len(records), length, dtype=torch.long)  # [B, L]
    for b, record in enumerate(records):
        hidden_states[b, len(record.input_ids) :] *= 50
        input_ids[b, : len(record.input_ids)] = torch.tensor(record.input_ids)
        attention_mask[b, : len(record.input_ids)] = 1
    output_embedding_weight = torch.randn(VOCABULARY, CONFIG["hidden_size"], generator=generator)  # [V, H]
    return hidden_states.to(dtype), input_ids, attention_mask, records, output_embedding_weight.to(dtype)


def flat(logits: list[list[torch.Tensor]]) -> torch.Tensor:
    return torch.cat([question.float() for record in logits for question in record])


@torch.inference_mode()
def test_fp32_logits_are_the_reference_heads():
    for seed in range(3):
        head = random_head(seed)
        inputs = head_inputs(random_records(seed), seed)
        expected = head(*inputs)
        got = serve_clef.BatchedJointSchemaHead(head)(*inputs)
        assert [[q.shape for q in record] for record in got] == [[q.shape for q in record] for record in expected]
        for got_record, expected_record in zip(got, expected, strict=True):
            for got_question, expected_question in zip(got_record, expected_record, strict=True):
                torch.testing.assert_close(got_question, expected_question, **FP32_TOLERANCE)


@torch.inference_mode()
def test_a_record_scores_the_same_alone_and_in_a_padded_batch():
    head = serve_clef.BatchedJointSchemaHead(random_head(0))
    records = random_records(0)
    hidden_states, input_ids, attention_mask, _, output_embedding_weight = head_inputs(records, 0)
    batched = head(hidden_states, input_ids, attention_mask, records, output_embedding_weight)
    for b, record in enumerate(records):
        length = len(record.input_ids)
        alone = head(hidden_states[b : b + 1, :length], input_ids[b : b + 1, :length],
                     attention_mask[b : b + 1, :length], [record], output_embedding_weight)[0]
        for in_batch, by_itself in zip(batched[b], alone, strict=True):
            torch.testing.assert_close(in_batch, by_itself, **FP32_TOLERANCE)


@torch.inference_mode()
def test_bf16_logits_are_the_reference_heads_within_bf16_noise():
    for seed in range(3):
        head = random_head(seed)
        records = random_records(seed)
        exact = flat(head(*head_inputs(records, seed)))
        head.to(torch.bfloat16)
        inputs = head_inputs(records, seed, torch.bfloat16)
        expected = flat(head(*inputs))
        got = flat(serve_clef.BatchedJointSchemaHead(head)(*inputs))
        assert (got - expected).abs().max() <= BF16_TOLERANCE * max(1.0, expected.abs().max().item())
        assert (got - exact).abs().max() <= BF16_ERROR_FACTOR * (expected - exact).abs().max()


class TorchCallCounter(TorchFunctionMode):
    """Counts the torch functions and tensor methods called inside it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def torch_calls(head, inputs) -> int:
    with torch.inference_mode(), TorchCallCounter() as counter:
        head(*inputs)
    return counter.calls


def test_the_number_of_operations_does_not_grow_with_records_questions_or_options():
    """The same torch calls (so the same kernel launches) for 1, 2 and 5 records of 1 to 4 questions, where the
    reference head's calls grow with every record, question and option."""
    head = random_head(0)
    records = random_records(0)
    batches = [records[1:2], records[:2], records]
    batched_calls = [torch_calls(serve_clef.BatchedJointSchemaHead(head), head_inputs(batch, 0)) for batch in batches]
    reference_calls = [torch_calls(head, head_inputs(batch, 0)) for batch in batches]
    assert len(set(batched_calls)) == 1
    assert reference_calls[0] < reference_calls[1] < reference_calls[2]
    assert batched_calls[0] < reference_calls[2]


def packed_rows(hidden_states: torch.Tensor, records: list, padding_rows: int) -> torch.Tensor:
    """The records' real rows of a right-padded batch [B, L, H], record after record, then `padding_rows` rows of
    large noise, as the text decoder's bucket leaves them -> [T, H]."""
    rows = torch.cat([hidden_states[b, :len(record.input_ids)] for b, record in enumerate(records)])
    return torch.cat([rows, 100 * torch.randn(padding_rows, rows.shape[1], dtype=rows.dtype)])


@torch.inference_mode()
def test_padding_slots_and_padding_rows_change_no_logit():
    """The slots of HEAD_GRAPH_SLOTS (what the graphs replay) against the records' exact slots, with and without the
    decoder bucket's padding rows after the records: the same logits to float rounding; every slot finite."""
    head = serve_clef.BatchedJointSchemaHead(random_head(1))
    records = random_records(1)
    hidden_states, _, _, _, output_embedding_weight = head_inputs(records, 1)
    needed = serve_clef.head_slots_needed(records)
    slots = next(slots for slots in serve_clef.HEAD_GRAPH_SLOTS if slots.holds(needed))
    assert slots != needed
    logits = {}
    for name, row_padding, index_slots in (("exact", 0, needed), ("graph slots", 0, slots),
                                           ("graph slots and padding rows", 37, slots)):
        index = serve_clef.head_index(records, index_slots)
        got = head.option_logits(packed_rows(hidden_states, records, row_padding), index, output_embedding_weight,
                                 index.option_token_ids)
        assert got.shape == (index_slots.options,) and torch.isfinite(got).all()
        logits[name] = got[:needed.options]
    torch.testing.assert_close(logits["graph slots"], logits["exact"], **FP32_TOLERANCE)
    torch.testing.assert_close(logits["graph slots and padding rows"], logits["exact"], **FP32_TOLERANCE)
    reference = flat(head.head(*head_inputs(records, 1)))
    torch.testing.assert_close(logits["graph slots and padding rows"], reference, **FP32_TOLERANCE)


@torch.inference_mode()
def test_a_batch_past_the_largest_slots_runs_on_its_own_slots(monkeypatch):
    monkeypatch.setattr(serve_clef, "HEAD_GRAPH_SLOTS", (serve_clef.HeadSlots(8, 2, 8, 64, 64),))
    head = random_head(4)
    inputs = head_inputs(random_records(4), 4)
    torch.testing.assert_close(flat(serve_clef.BatchedJointSchemaHead(head)(*inputs)), flat(head(*inputs)),
                               **FP32_TOLERANCE)


@torch.inference_mode()
def test_an_index_of_padding_only_gives_finite_logits():
    """What the graphs are captured on: every slot padding, no record owning a row."""
    head = serve_clef.BatchedJointSchemaHead(random_head(2))
    index = serve_clef.head_index([], serve_clef.HEAD_GRAPH_SLOTS[0])
    assert (index.question_records == -1).all() and (index.option_questions == -1).all()
    got = head.option_logits(torch.randn(64, CONFIG["hidden_size"]), index, torch.randn(VOCABULARY,
                             CONFIG["hidden_size"]), index.option_token_ids)
    assert torch.isfinite(got).all()


def test_the_index_holds_each_records_spans_and_ids():
    """head_index against the records' own spans: rows of the packed tokens, offsets, ids and owners."""
    records = random_records(3)
    slots = serve_clef.HEAD_GRAPH_SLOTS[0]
    index = serve_clef.head_index(records, slots)
    starts = [0]
    for record in records:
        starts.append(starts[-1] + len(record.input_ids))
    questions = [(b, question) for b, record in enumerate(records) for question in record.questions]
    spans = [(starts[b] + question.question_span[0], starts[b] + question.question_span[1])
             for b, question in questions]
    spans += [(starts[b] + start, starts[b] + end) for b, question in questions for start, end in question.option_spans]
    offsets = index.span_offsets.tolist()
    question_bags = offsets[:len(questions)]
    option_bags = offsets[slots.questions:slots.questions + len(spans) - len(questions)]
    bag_starts = question_bags + option_bags
    bag_ends = bag_starts[1:] + [offsets[slots.questions + len(spans) - len(questions)]]
    for (start, end), bag_start, bag_end in zip(spans, bag_starts, bag_ends, strict=True):
        assert index.span_token_rows[bag_start:bag_end].tolist() == list(range(start, end))
    assert index.record_ends[:len(records)].tolist() == starts[1:]
    assert index.last_token_rows[:len(records)].tolist() == [end - 1 for end in starts[1:]]
    assert index.question_records.tolist() == [b for b, _ in questions] + [-1] * (slots.questions - len(questions))
    option_ids = [token for record in records for question in record.questions
                  for start, end in question.option_spans for token in record.input_ids[start:end]]
    assert index.option_token_ids[:len(option_ids)].tolist() == option_ids
    option_questions = [q for q, (_, question) in enumerate(questions) for _ in question.option_spans]
    assert index.option_questions.tolist() == option_questions + [-1] * (slots.options - len(option_questions))


def test_the_padding_tokens_are_shared_by_the_padding_spans():
    """In the graphs' slots, the padding option slots and the span after them share the padding span tokens and
    option tokens evenly (embedding_bag sums each span row after row), the real spans are as they were, and the count
    of real option tokens is given."""
    records = random_records(3)
    needed = serve_clef.head_slots_needed(records)
    slots = serve_clef.HEAD_GRAPH_SLOTS[0]
    index = serve_clef.head_index(records, slots)
    exact = serve_clef.head_index(records, needed)
    for offsets, exact_offsets, real_spans, real_tokens, token_slots in (
            (index.span_offsets[slots.questions:], exact.span_offsets[needed.questions:], needed.options,
             needed.span_tokens, slots.span_tokens),
            (index.option_offsets, exact.option_offsets, needed.options, needed.option_tokens, slots.option_tokens)):
        assert offsets[:real_spans + 1].tolist() == exact_offsets[:real_spans + 1].tolist()  # the real spans
        padding_lengths = (torch.cat([offsets[real_spans + 1:], torch.tensor([token_slots])])
                           - offsets[real_spans:]).tolist()  # the padding slots' and the last span's
        assert len(padding_lengths) == slots.options - needed.options + 1
        assert sum(padding_lengths) == token_slots - real_tokens
        assert max(padding_lengths) - min(padding_lengths) <= 1
    assert index.option_token_count.tolist() == [needed.option_tokens]


def test_the_head_s_attention_kernels_leave_torch_s_choice_as_it_was():
    """On CUDA the head's attention prefers cuDNN's kernel; afterwards torch's order of preference and its enabled
    kernels are exactly as before, also when cuDNN's was switched off (as bench/check_engine_gpu.py does between
    runs). Only flags are set, so this runs without a GPU."""
    order = torch._C._get_sdp_priority_order()
    try:
        for cudnn_enabled in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(cudnn_enabled)
            with serve_clef.head_attention_kernels(torch.device("cuda")):
                assert torch.backends.cuda.cudnn_sdp_enabled()
                assert torch._C._get_sdp_priority_order()[0] == int(serve_clef.SDPBackend.CUDNN_ATTENTION)
            assert torch._C._get_sdp_priority_order() == order
            assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn_enabled
        with serve_clef.head_attention_kernels(torch.device("cpu")):
            assert torch._C._get_sdp_priority_order() == order
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
        torch._C._set_sdp_priority_order(order)


# ---- the head of a served model --------------------------------------------------------------------------------------

REQUESTS = [  # three records of different lengths, every question type, 1 to 2 questions
    *ENGINE_REQUESTS,
    {"model": "clef-omni", "state": {"k": [1, 2, 3]},
     "questions": {"x": {"type": "score", "criteria": ["low", "mid", "high", "top"]}, "y": {"type": "noul"}}},
]


@pytest.fixture(scope="module")
def served():
    """The tiny synthetic model as load_clef serves it, and the lines its load printed."""
    lines = []
    loaded = serve_clef.load_clef("synthetic", device="cpu", progress=lines.append)
    return loaded, lines


@pytest.fixture
def release_head(served):
    """The release's own head (the one the batched head wraps); the batched head is put back after the test."""
    loaded, _ = served
    batched = loaded.model.head
    yield batched.head
    loaded.model.head = batched


def test_load_installs_the_batched_head_and_answers_stay_the_release_heads(served, release_head):
    loaded, lines = served
    batched = loaded.model.head
    assert isinstance(batched, serve_clef.BatchedJointSchemaHead) and batched.head is release_head
    assert any(line.startswith("joint head: batched") for line in lines)
    prepared = [serve_clef.prepare(loaded, request, 4096) for request in REQUESTS]
    encoded = [record.encoded for record in prepared]
    batched_logits = serve_clef.score_records(loaded, encoded)
    loaded.model.head = release_head
    release_logits = serve_clef.score_records(loaded, encoded)
    got, expected = flat(batched_logits), flat(release_logits)
    assert (got - expected).abs().max() <= BF16_TOLERANCE * max(1.0, expected.abs().max().item())
    for record, got_logits, expected_logits in zip(prepared, batched_logits, release_logits, strict=True):
        got_answers = serve_clef.answer(loaded, record, got_logits)["answers"]
        expected_answers = serve_clef.answer(loaded, record, expected_logits)["answers"]
        assert largest_difference(got_answers, expected_answers) <= ANSWER_NOISE


@torch.inference_mode()
def test_the_graph_path_gives_the_op_by_op_logits(served, release_head):
    """The forward's graph path on CPU, each graph stood in for by what it holds (run_static: the head on the static
    index and the decoder's static rows): each batch's index written into the static one and its logits read back,
    batches of other sizes in turn, bit for bit the op-by-op head's."""
    loaded, _ = served
    head = loaded.model.head
    table = loaded.model.output_embeddings.weight
    records = [serve_clef.prepare(loaded, request, 4096).encoded for request in REQUESTS]
    batches = [records, records[:1], records[1:], records[2:], records]
    op_by_op = [serve_clef.score_records(loaded, batch) for batch in batches]
    largest = serve_clef.HEAD_GRAPH_SLOTS[-1]
    head.static_index = torch.zeros(serve_clef.head_index([], largest).flat().numel(), dtype=torch.long)
    head.static_logits = torch.zeros(largest.options, dtype=table.dtype)
    replays = []

    def stand_in(bucket, slots):
        def replay():
            replays.append((bucket, slots))
            head.run_static(bucket, slots, table)
        return types.SimpleNamespace(replay=replay)

    head.graphs = {(bucket, slots): stand_in(bucket, slots) for bucket in head.decoder.buckets
                   for slots in serve_clef.HEAD_GRAPH_SLOTS}
    try:
        replayed = [serve_clef.score_records(loaded, batch) for batch in batches]
        assert len(replays) == len(batches)
        # the load's own check of the graphs, against graphs that hold the head, then against ones that do nothing
        assert serve_clef.head_graphs_agree(loaded.model, loaded.schema, loaded.processor)
        head.graphs = dict.fromkeys(head.graphs, types.SimpleNamespace(replay=lambda: None))
        assert not serve_clef.head_graphs_agree(loaded.model, loaded.schema, loaded.processor)
    finally:
        head.graphs, head.static_index, head.static_logits = {}, None, None
    for got, expected in zip(replayed, op_by_op, strict=True):
        assert all(torch.equal(a, b) for record_a, record_b in zip(got, expected, strict=True)
                   for a, b in zip(record_a, record_b, strict=True))


@torch.inference_mode()
def test_the_head_reads_the_decoders_packed_rows_only_behind_its_own_output(served, release_head):
    """packed_rows_behind hands the packed rows to the forward's own [B, L, H] output (or a view of it), once; any
    other tensor of that shape gets None. Scored with the release head, which leaves the rows on offer."""
    loaded, _ = served
    decoder = loaded.model.head.decoder
    records = [serve_clef.prepare(loaded, request, 4096).encoded for request in REQUESTS]
    loaded.model.head = release_head
    serve_clef.score_records(loaded, records)
    returned, _ = decoder.packed_output
    assert decoder.packed_rows_behind(torch.zeros_like(returned)) is None
    assert decoder.packed_output is None
    serve_clef.score_records(loaded, records)
    returned, _ = decoder.packed_output
    rows = decoder.packed_rows_behind(returned[:, :])
    real = torch.cat([returned[b, :len(record.input_ids)] for b, record in enumerate(records)])  # [T, H]
    assert rows.shape[0] in decoder.buckets and rows.shape[0] >= real.shape[0]
    assert torch.equal(rows[:real.shape[0]], real)
    assert decoder.packed_rows_behind(returned) is None


class UniformHead(torch.nn.Module):
    """A decision module's head unlike JointSchemaHead: the same forward signature, none of its modules, every option
    of a question equally likely."""

    def __init__(self):
        super().__init__()
        self.logit = torch.nn.Parameter(torch.zeros((), dtype=torch.bfloat16))

    def forward(self, hidden_states, input_ids, attention_mask, records, output_embedding_weight):
        return [[self.logit.expand(len(question.option_spans)) for question in record.questions] for record in records]


class DoubledHead(jsm.JointSchemaHead):
    """JointSchemaHead's modules and parameters with other maths: every logit doubled."""

    def forward(self, *inputs):
        return [[2 * question for question in record] for record in super().forward(*inputs)]


def test_a_head_unlike_joint_schema_head_keeps_serving(served, release_head):
    loaded, _ = served
    foreign = UniformHead()
    loaded.model.head = foreign
    lines = []
    serve_clef.install_batched_head(loaded.model, loaded.schema, loaded.processor, lines.append)
    assert loaded.model.head is foreign
    assert len(lines) == 1 and lines[0].startswith("joint head: the release's own (the batched head cannot run it")
    answers = serve_clef.decide(loaded, REQUESTS[1], 4096)["answers"]
    assert answers["team"]["probabilities"] == {"billing": 0.3333, "shipping": 0.3333, "support": 0.3333}


def test_a_head_with_other_maths_keeps_serving(served, release_head):
    loaded, _ = served
    config = json.loads((loaded.checkpoint_dir / "joint_head_config.json").read_text())
    doubled = DoubledHead(**config).to(torch.bfloat16).eval()
    doubled.load_state_dict(release_head.state_dict())
    loaded.model.head = doubled
    lines = []
    serve_clef.install_batched_head(loaded.model, loaded.schema, loaded.processor, lines.append)
    assert loaded.model.head is doubled
    assert len(lines) == 1 and lines[0].startswith("joint head: the release's own (on the load's check batch")


def test_healthz_says_which_head_serves(served, release_head):
    loaded, _ = served
    args = serve_clef.parse_args([*SERVER_ARGS, "--api-key", ""])
    with serve_in_thread(serve_clef.create_app(args, load=lambda args, progress: loaded)) as url:
        wait_until_ready(url, limit_s=TIMEOUT_S)
        assert requests.get(f"{url}/healthz", timeout=TIMEOUT_S).json()["joint_head"] == "batched"
        loaded.model.head = UniformHead()
        assert requests.get(f"{url}/healthz", timeout=TIMEOUT_S).json()["joint_head"] == "release"
