"""The joint schema head: parameter names, shapes and counts from the spec, and the forward against an independent
float64 computation of the spec's formulas (docs/decision-api.md §7-§8)."""

import math

import pytest
import torch

import joint_schema_model as jsm


def expected_shapes(H, W, F, R, L):
    """Every parameter of joint_head.safetensors, written out from the spec's tables."""
    shapes = {"hidden_norm.weight": [H], "hidden_norm.bias": [H]}
    for name in (
        "memory_projection",
        "question_projection",
        "option_question_projection",
        "global_projection",
        "option_context_projection",
        "option_lexical_projection",
    ):
        shapes[f"{name}.weight"] = [W, H]
    shapes["type_embedding.weight"] = [3, W]
    for i in range(R):
        p = f"evidence_layers.{i}."
        for norm in ("query_norm", "memory_norm", "feedforward_norm"):
            shapes[p + norm + ".weight"] = [W]
            shapes[p + norm + ".bias"] = [W]
        shapes[p + "attention.in_proj_weight"] = [3 * W, W]
        shapes[p + "attention.in_proj_bias"] = [3 * W]
        shapes[p + "attention.out_proj.weight"] = [W, W]
        shapes[p + "attention.out_proj.bias"] = [W]
        shapes[p + "feedforward.0.weight"] = [F, W]
        shapes[p + "feedforward.0.bias"] = [F]
        shapes[p + "feedforward.3.weight"] = [W, F]
        shapes[p + "feedforward.3.bias"] = [W]
    for norm in ("option_summary_norm", "field_norm", "option_norm"):
        shapes[norm + ".weight"] = [W]
        shapes[norm + ".bias"] = [W]
    for j in range(L):
        p = f"layers.{j}."
        for attention in ("self_attn", "multihead_attn"):
            shapes[p + attention + ".in_proj_weight"] = [3 * W, W]
            shapes[p + attention + ".in_proj_bias"] = [3 * W]
            shapes[p + attention + ".out_proj.weight"] = [W, W]
            shapes[p + attention + ".out_proj.bias"] = [W]
        shapes[p + "linear1.weight"] = [F, W]
        shapes[p + "linear1.bias"] = [F]
        shapes[p + "linear2.weight"] = [W, F]
        shapes[p + "linear2.bias"] = [W]
        for norm in ("norm1", "norm2", "norm3"):
            shapes[p + norm + ".weight"] = [W]
            shapes[p + norm + ".bias"] = [W]
    shapes["residual_scorer.0.weight"] = [W, 4 * W]
    shapes["residual_scorer.0.bias"] = [W]
    shapes["residual_scorer.3.weight"] = [1, W]
    shapes["residual_scorer.3.bias"] = [1]
    for scalar in ("prior_logit_scale", "joint_logit_scale", "residual_gate"):
        shapes[scalar] = []
    return shapes


@pytest.mark.parametrize(
    "hidden_size, published_count",
    [(5120, 128_056_324), (4096, 121_762_820)],  # clef and clef-flash, as published
)
def test_head_parameters_match_the_release_files(hidden_size, published_count):
    with torch.device("meta"):
        head = jsm.JointSchemaHead(hidden_size, 1024, 2, 4, 16, 4096)
    state = {name: list(tensor.shape) for name, tensor in head.state_dict().items()}
    assert state == expected_shapes(hidden_size, 1024, 4096, 2, 4)
    assert sum(p.numel() for p in head.parameters()) == published_count
    # The spec's closed form, as a second check on the table.
    H, W, F, R, L = hidden_size, 1024, 4096, 2, 4
    closed_form = (
        2 * H
        + 6 * W * H
        + 3 * W
        + R * (4 * W * W + 2 * W * F + 11 * W + F)
        + 2 * W
        + L * (8 * W * W + 2 * W * F + 15 * W + F)
        + 4 * W
        + (4 * W * W + 2 * W + 1)
        + 3
    )
    assert closed_form == published_count


def test_scalars_start_at_zero_and_config_keys_are_the_constructor_arguments():
    head = jsm.JointSchemaHead(hidden_size=16, width=8, routing_layers=1, layers=1, heads=2, feedforward=16)
    for scalar in (head.prior_logit_scale, head.joint_logit_scale, head.residual_gate):
        assert scalar.shape == () and scalar.item() == 0.0
    config = {
        "hidden_size": 16,
        "width": 8,
        "routing_layers": 1,
        "layers": 1,
        "heads": 2,
        "feedforward": 16,
        "dropout": 0.0,
    }
    jsm.JointSchemaHead(**config)  # joint_head_config.json is splatted into the constructor


# ---- an independent float64 implementation of the spec's formulas ------------------------------------------------


def layer_norm(x, p, name):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * p[name + ".weight"] + p[name + ".bias"]


def gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def attention(query, key_value, p, name, heads):
    """Multi-head attention from the packed in_proj weights, no masks. query [n,W], key_value [t,W]."""
    W = query.shape[-1]
    wq, wk, wv = p[name + ".in_proj_weight"].split(W)
    bq, bk, bv = p[name + ".in_proj_bias"].split(W)
    q, k, v = query @ wq.T + bq, key_value @ wk.T + bk, key_value @ wv.T + bv
    d = W // heads
    out = []
    for h in range(heads):
        qh, kh, vh = q[:, h * d : (h + 1) * d], k[:, h * d : (h + 1) * d], v[:, h * d : (h + 1) * d]
        weights = torch.softmax(qh @ kh.T / math.sqrt(d), dim=-1)
        out.append(weights @ vh)
    return torch.cat(out, -1) @ p[name + ".out_proj.weight"].T + p[name + ".out_proj.bias"]


def linear(x, p, name, bias=True):
    y = x @ p[name + ".weight"].T
    return y + p[name + ".bias"] if bias else y


def reference_logits(p, config, hidden, input_ids, record, lm_head):
    """Logits of one unpadded record, straight from docs/decision-api.md §7-§8, in float64."""
    W, heads = config["width"], config["heads"]
    seq = layer_norm(hidden, p, "hidden_norm")  # [T,H]
    memory = linear(seq, p, "memory_projection", bias=False)  # [T,W]
    g = seq[-1]
    qv = torch.stack([seq[s:e].mean(0) for s, e in (q.question_span for q in record.questions)])
    routed, lexicals = [], []
    for k, q in enumerate(record.questions):
        C = torch.stack([seq[s:e].mean(0) for s, e in q.option_spans])
        X = torch.stack([lm_head[input_ids[s:e]].mean(0) for s, e in q.option_spans])
        lexicals.append(X)
        routed.append(
            linear(C, p, "option_context_projection", False)
            + linear(X, p, "option_lexical_projection", False)
            + linear(qv[k], p, "option_question_projection", False)
        )
    routed = torch.cat(routed)
    for i in range(config["routing_layers"]):
        n = f"evidence_layers.{i}."
        m = layer_norm(memory, p, n + "memory_norm")
        routed = routed + attention(layer_norm(routed, p, n + "query_norm"), m, p, n + "attention", heads)
        hidden_ff = gelu(linear(layer_norm(routed, p, n + "feedforward_norm"), p, n + "feedforward.0"))
        routed = routed + linear(hidden_ff, p, n + "feedforward.3")
    counts = [len(q.option_spans) for q in record.questions]
    per_question = list(routed.split(counts))
    base = linear(qv, p, "question_projection", False)
    summaries = []
    for k, r in enumerate(per_question):
        w = torch.softmax(r @ base[k] / math.sqrt(W), 0)
        summaries.append((w[:, None] * r).sum(0))
    type_ids = [q.question_type for q in record.questions]
    x = (
        base
        + layer_norm(torch.stack(summaries), p, "option_summary_norm")
        + linear(g, p, "global_projection", False)[None]
        + p["type_embedding.weight"][type_ids]
    )
    for j in range(config["layers"]):
        n = f"layers.{j}."
        x = x + attention(layer_norm(x, p, n + "norm1"), layer_norm(x, p, n + "norm1"), p, n + "self_attn", heads)
        x = x + attention(layer_norm(x, p, n + "norm2"), memory, p, n + "multihead_attn", heads)
        x = x + linear(gelu(linear(layer_norm(x, p, n + "norm3"), p, n + "linear1")), p, n + "linear2")
    fields = layer_norm(x, p, "field_norm")

    def scale(t):
        return torch.exp(torch.clamp(t, max=math.log(100.0)))

    logits = []
    for k, r in enumerate(per_question):
        anchor = (qv[k] + g) / max((qv[k] + g).norm(), 1e-12)
        lex = lexicals[k] / lexicals[k].norm(dim=-1, keepdim=True).clamp(min=1e-12)
        prior = scale(p["prior_logit_scale"]) * (lex @ anchor)
        o = layer_norm(r, p, "option_norm")
        f = fields[k].expand_as(o)
        cos = (f * o).sum(-1) / (f.norm(dim=-1).clamp(min=1e-8) * o.norm(dim=-1).clamp(min=1e-8))
        hidden_r = gelu(linear(torch.cat([f, o, f * o, (f - o).abs()], -1), p, "residual_scorer.0"))
        residual = linear(hidden_r, p, "residual_scorer.3").squeeze(-1)
        gate = 1.0 / (1.0 + torch.exp(-p["residual_gate"]))
        logits.append(prior + gate * (scale(p["joint_logit_scale"]) * cos + residual))
    return logits


def test_head_forward_matches_independent_float64_formulas():
    torch.manual_seed(0)
    config = {"hidden_size": 24, "width": 16, "routing_layers": 2, "layers": 2, "heads": 4, "feedforward": 32}
    head = jsm.JointSchemaHead(**config).double().eval()
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
        head.prior_logit_scale.fill_(0.7)
        head.joint_logit_scale.fill_(5.0)  # above log(100): the clamp must cap it
        head.residual_gate.fill_(-0.4)
    p = {name: tensor.detach() for name, tensor in head.state_dict().items()}

    T, V = 40, 50
    records = [
        jsm.EncodedRecord(
            input_ids=tuple(range(T)),
            questions=(
                jsm.EncodedQuestion("a", 1, (5, 9), ((10, 13), (13, 14), (15, 20)), ("x", "y", "z")),
                jsm.EncodedQuestion("b", 0, (21, 22), ((23, 26), (26, 30)), ("true", "false")),
                jsm.EncodedQuestion("c", 2, (30, 33), ((33, 35), (35, 37)), ("0", "1")),
            ),
            record_id="r0",
        ),
        jsm.EncodedRecord(
            input_ids=tuple(range(25)),
            questions=(jsm.EncodedQuestion("q", 1, (2, 4), ((5, 7), (8, 12)), ("m", "n")),),
            record_id="r1",
        ),
    ]
    hidden = torch.randn(2, T, 24, dtype=torch.float64)
    input_ids = torch.randint(0, V, (2, T))
    attention_mask = torch.zeros(2, T, dtype=torch.long)
    attention_mask[0, :T] = 1
    attention_mask[1, :25] = 1
    lm_head = torch.randn(V, 24, dtype=torch.float64)

    with torch.no_grad():
        got = head(hidden, input_ids, attention_mask, records, lm_head)
    for b, record in enumerate(records):
        n = int(attention_mask[b].sum())
        expected = reference_logits(p, config, hidden[b, :n], input_ids[b, :n], record, lm_head)
        assert len(got[b]) == len(expected) == len(record.questions)
        for got_q, expected_q in zip(got[b], expected):
            torch.testing.assert_close(got_q, expected_q, rtol=1e-9, atol=1e-9)
