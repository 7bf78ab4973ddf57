"""Our qwen4_exp network against transformers' on a tiny random model, and its state handling."""

import math

import pytest
import torch

from expertstream.experts.cpu_bank import DenseExperts
from expertstream.formats.fp8 import dequantize_fp8_rows, quantize_fp8_rows
from expertstream.models.attention import index_mask, kv_bucket
from expertstream.models.base import ModelArgs
from expertstream.models.qwen4_exp import Qwen4ExpModel
from expertstream.models.state import State
from expertstream.store.ple import DenseTable

qwen4 = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig  # noqa: E402

EOS = 7
VOCAB = 320
PROMPT = 100


def tiny_config() -> Qwen4ExpTextConfig:
    cfg = Qwen4ExpTextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=12,
        num_experts_per_tok=3,
        # "full_attention" is the shipped spelling of an indexed (QSA) layer
        layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"],
        hc_count=4,
        hc_lowrank=16,
        ple_layer_ids=[2],
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=8,
        eos_token_id=EOS,
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=32,
        indexer_budget=16,
        indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        output_gate_type="sigmoid",
        max_position_embeddings=256,
    )
    cfg._attn_implementation = "eager"
    return cfg


def randomise(model: torch.nn.Module) -> None:
    """Make every norm, gate and conv non-trivial so nothing reduces to an identity."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(
                    0.3 * torch.randn(p.shape, generator=g)
                    + (1.0 if name.endswith("linear_attn.norm.weight") else 0)
                )
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g))  # decisive routing, no near-ties in top-k
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def ours_from_tf(tf_model, dtype=torch.float32, fp8_names=()):
    """Our model from transformers' weights; `fp8_names` are stored FP8 row-scaled (quantised here)."""
    cfg = tf_model.config
    sd = {k.removeprefix("model."): v.detach().clone() for k, v in tf_model.state_dict().items()}
    args = ModelArgs.from_dict(cfg.to_dict())
    bank = DenseExperts(
        [sd.pop(f"layers.{i}.mlp.experts.gate_up_proj") for i in range(args.num_hidden_layers)],
        [sd.pop(f"layers.{i}.mlp.experts.down_proj") for i in range(args.num_hidden_layers)],
    )
    table = DenseTable(sd.pop("layers.1.ple.ple_embedding.ngram_embedding.weight"))
    for name in fp8_names:
        sd[name], sd[f"{name}_scale"] = quantize_fp8_rows(sd[name])
    return Qwen4ExpModel(args, sd, bank, table, dtype=dtype, fp8_row_scaled=fp8_names), args


def prompt_ids(seed: int = 0, n: int = PROMPT) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))
    ids[ids == EOS] = EOS + 1
    ids[[30, 31, 71]] = EOS  # documents end inside the prompt (two EOS in a row too)
    return ids


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    tf_model = qwen4.Qwen4ExpForCausalLM(tiny_config()).eval()
    randomise(tf_model)
    ours, args = ours_from_tf(tf_model)
    ids = prompt_ids(1)  # this prompt has tied (zero) block scores at the budget boundary
    with torch.no_grad():
        ref = tf_model(ids[None], use_cache=False).logits[0].float()
    st = State(args, 256, torch.float32, "cpu")
    full = ours.logits(ours(ids, st))
    return tf_model, ours, args, ids, ref, full


def test_logits_match_transformers(pair):
    _, _, args, _, ref, full = pair
    assert (
        PROMPT // args.indexer_compress_ratio > args.indexer_budget // args.indexer_compress_ratio
    )  # blocks dropped
    scale = ref.abs().max()
    assert (full - ref).abs().max() <= 1e-4 * scale
    assert torch.equal(full.argmax(-1), ref.argmax(-1))


def test_indexer_drops_blocks_and_changes_output(pair):
    # the same weights with an unlimited budget must differ: the selection is really exercised
    tf_model, _, _, ids, _, full = pair
    cfg = tiny_config()
    cfg.indexer_budget = 4096
    wide = qwen4.Qwen4ExpForCausalLM(cfg).eval()
    wide.load_state_dict(tf_model.state_dict())
    ours_wide, args = ours_from_tf(wide)
    out = ours_wide.logits(ours_wide(ids, State(args, 256, torch.float32, "cpu")))
    assert (out - full).abs().max() > 1e-3


def test_decode_step_by_step_matches_full(pair):
    _, ours, args, ids, _, full = pair
    st = State(args, 256, torch.float32, "cpu")
    steps = torch.stack([ours.logits(ours(ids[i : i + 1], st))[0] for i in range(PROMPT)])
    assert st.pos == PROMPT and st.tokens == ids.tolist()
    assert (steps - full).abs().max() <= 1e-4 * full.abs().max()
    assert torch.equal(steps.argmax(-1), full.argmax(-1))


def test_kv_bucket_is_a_power_of_two_window_capped_by_the_context():
    assert [kv_bucket(s, 4096) for s in (1, 256, 257, 512, 513, 3000)] == [256, 256, 512, 512, 1024, 4096]
    assert kv_bucket(5, 128) == 128 and kv_bucket(4096, 4096) == 4096


def test_decode_across_kv_windows_matches_full(pair):
    """One-token steps attend over a window of kv_bucket rows: 256, then 512 past 256 tokens."""
    _, ours, args, _, _, _ = pair
    ids = prompt_ids(3, 300)
    full = ours.logits(ours(ids, State(args, 600, torch.float32, "cpu")))
    st = State(args, 600, torch.float32, "cpu")
    ours(ids[:200], st)
    steps = torch.stack([ours.logits(ours(ids[i : i + 1], st))[0] for i in range(200, 300)])
    assert (steps - full[200:]).abs().max() <= 1e-4 * full.abs().max()
    assert torch.equal(steps.argmax(-1), full[200:].argmax(-1))


def test_split_prompt_matches_full(pair):
    _, ours, args, ids, _, full = pair
    st = State(args, 256, torch.float32, "cpu")
    a = ours.logits(ours(ids[:37], st))
    b = ours.logits(ours(ids[37:], st))
    both = torch.cat((a, b))
    assert (both - full).abs().max() <= 1e-4 * full.abs().max()


def test_prompt_ending_mid_block_then_decode_matches_full(pair):
    # the indexer block open at the end of the prompt is completed by decode steps (cached block keys)
    _, ours, args, ids, _, full = pair
    st = State(args, 256, torch.float32, "cpu")
    assert 37 % args.indexer_compress_ratio
    rows = [ours.logits(ours(ids[:37], st))]
    rows += [ours.logits(ours(ids[i : i + 1], st)) for i in range(37, 50)]
    snap = st.snapshot()  # mid-block again
    rows += [ours.logits(ours(ids[i : i + 1], st)) for i in range(50, PROMPT)]
    got = torch.cat(rows)
    assert (got - full).abs().max() <= 1e-4 * full.abs().max()
    assert torch.equal(got.argmax(-1), full.argmax(-1))
    st.restore(snap)
    again = torch.cat([ours.logits(ours(ids[i : i + 1], st)) for i in range(50, PROMPT)])
    assert torch.equal(again, got[50:])


def test_snapshot_restore_continues_identically(pair):
    _, ours, args, ids, _, _ = pair
    st = State(args, 256, torch.float32, "cpu")
    ours(ids[:60], st)
    snap = st.snapshot()
    first = torch.stack([ours.logits(ours(ids[i : i + 1], st))[0] for i in range(60, 70)])
    st.restore(snap)
    assert st.pos == 60 and st.tokens == ids[:60].tolist()
    again = torch.stack([ours.logits(ours(ids[i : i + 1], st))[0] for i in range(60, 70)])
    assert torch.equal(first, again)
    # only the filled part of KV is copied: far less than the preallocated 256 positions
    full_kv = sum(t.numel() * t.element_size() for d in (st.k, st.v, st.idx_k) for t in d.values())
    assert snap.nbytes < full_kv


def test_fp8_row_scaled_linears_equal_dequantized(pair):
    tf_model, _, args, ids, _, _ = pair
    names = ("layers.0.linear_attn.in_proj_qkv.weight", "layers.3.self_attn.o_proj.weight", "lm_head.weight")
    fp8_model, _ = ours_from_tf(tf_model, fp8_names=names)
    # the dense twin holds exactly the dequantized FP8 values
    ref_tf = qwen4.Qwen4ExpForCausalLM(tiny_config()).eval()
    sd = tf_model.state_dict()
    for n in names:
        key = n if n.startswith("lm_head") else f"model.{n}"
        sd[key] = dequantize_fp8_rows(*quantize_fp8_rows(sd[key]))
    ref_tf.load_state_dict(sd)
    dense_model, _ = ours_from_tf(ref_tf)
    a = fp8_model.logits(fp8_model(ids, State(args, 256, torch.float32, "cpu")))
    b = dense_model.logits(dense_model(ids, State(args, 256, torch.float32, "cpu")))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_prompt_longer_than_max_model_len_is_refused(pair):
    _, ours, args, ids, _, _ = pair
    with pytest.raises(ValueError, match="max_model_len"):
        ours(ids, State(args, 50, torch.float32, "cpu"))


def reference_index_mask(qi, qpos, bk, s, c, topk):
    """transformers' selection, one query at a time (Qwen4ExpTextQSAIndexer.forward)."""
    out = torch.zeros(len(qpos), s, dtype=torch.bool)
    for r, p in enumerate(qpos.tolist()):
        nv = (p + 1) // c
        if nv:
            sc = torch.relu(qi[r].float() @ bk[:nv].float().T).sum(0) / math.sqrt(qi.shape[-1])
            for b in sc.topk(min(topk, nv)).indices.tolist():
                out[r, b * c : (b + 1) * c] = True
        out[r, nv * c : p + 1] = True
    return out


@pytest.mark.parametrize("heads", [1, 2, 8])
def test_index_mask_matches_per_query_selection_with_ties(heads):
    # few heads: many all-negative blocks score exactly 0, so the k-th score is often tied
    g = torch.Generator().manual_seed(heads)
    c, topk, s = 4, 3, 90
    qi, bk = torch.randn(s, heads, 8, generator=g), torch.randn(s // c, 8, generator=g)
    qpos = torch.arange(s)
    mask = index_mask(qi, qpos, bk, s, c, topk)
    assert torch.equal(mask, reference_index_mask(qi, qpos, bk, s, c, topk))
    assert not torch.equal(mask, torch.ones(s, s, dtype=torch.bool).tril())


def test_index_mask_is_causal_within_budget():
    c, topk, s = 4, 3, 12
    qpos = torch.arange(s)
    mask = index_mask(torch.randn(s, 2, 8), qpos, torch.randn(s // c, 8), s, c, topk)
    assert torch.equal(mask, torch.ones(s, s, dtype=torch.bool).tril())


def test_model_args_aliases_and_defaults():
    base = tiny_config().to_dict()
    base["layer_types"] = ["linear_attention"] * 3 + [
        "qwen_sparse_attention",
        "linear_attention",
        "indexed_attention",
    ]
    base["some_future_key"] = 1
    del base["output_gate_type"]
    base["hidden_act"] = "silu"
    args = ModelArgs.from_dict(base)
    assert args.layer_types[3] == args.layer_types[5] == "indexed_attention"
    assert args.output_gate_type == "silu"
    assert args.ple_layers == [1]
    base["layer_types"][0] = "mamba"
    with pytest.raises(ValueError, match="mamba"):
        ModelArgs.from_dict(base)
