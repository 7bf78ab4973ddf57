"""models/deepseek_v4.py against transformers' deepseek_v4 (eager, FP32) on the tiny synthetic checkpoint:
our forward reads the FP8 + MXFP4 files and dequantizes them, transformers loads the exact BF16 twin.
Bounds are check's FP32 ones; controls that change one piece of the network must break them."""

import pytest
import torch

from expertstream.commands.check import FP32_THRESHOLDS
from expertstream.experts.cpu_bank import DenseExperts
from expertstream.formats.snapshot import Snapshot
from expertstream.models import deepseek_v4 as ds4
from expertstream.models.deepseek_v4_reference import transformers_reference
from expertstream.synth.deepseek_v4 import write_synthetic_ds4

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds4m")
    q = write_synthetic_ds4(root / "fp8", "ds4-tiny", seed=4)
    twin = write_synthetic_ds4(root / "bf16", "ds4-tiny", seed=4, dtype="bf16")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        twin, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    snap = Snapshot(q)
    args = ds4.DeepseekV4Args.from_dict(snap.config)
    gate_up, down = ds4.dense_experts(snap, args)
    return args, ds4.load_weights(snap), (gate_up, down), ref


def _ours(args, weights, experts, ids):
    bank = DenseExperts(*experts, swiglu_limit=args.swiglu_limit)
    with torch.no_grad():
        model = ds4.DeepseekV4Model(args, weights, bank)
        return model.logits(model(ids))


def _ids(t: int, vocab: int) -> torch.Tensor:
    return (torch.arange(t) * 7 + 3) % vocab


@pytest.mark.parametrize("t", [3, 37, 300])  # 300: CSA keeps 4 of 75 entries, HCA has two
def test_matches_transformers_in_fp32(pair, t):
    args, weights, experts, ref = pair
    ids = _ids(t, args.vocab_size)
    ours = _ours(args, weights, experts, ids)
    with torch.no_grad():
        theirs = ref(ids[None]).logits[0]
    diff = (ours - theirs).abs()
    assert diff.mean() <= FP32_THRESHOLDS.mean_abs and diff.max() <= FP32_THRESHOLDS.max_abs
    assert theirs.std() > 0.5  # logits that carry signal


@pytest.mark.parametrize(
    "control",
    ["sinks", "indexer", "hca", "hash", "sinkhorn", "swiglu-limit", "swap-nibbles", "grouped-o"],
)
def test_controls_break_the_match(pair, control):
    args, weights, experts, ref = pair
    w, (gu, dn), a = dict(weights), experts, args
    if control == "sinks":
        w["layers.1.attn.attn_sink"] = torch.zeros_like(w["layers.1.attn.attn_sink"])
    elif control == "indexer":  # other scores pick other entries
        w["layers.3.attn.indexer.weights_proj.weight"] = -w["layers.3.attn.indexer.weights_proj.weight"]
    elif control == "hca":
        w["layers.2.attn.compressor.ape"] = w["layers.2.attn.compressor.ape"].flip(0) * 5
    elif control == "hash":
        w["layers.0.ffn.gate.tid2eid"] = (w["layers.0.ffn.gate.tid2eid"] + 1) % a.n_routed_experts
    elif control == "sinkhorn":
        a = type(args).from_dict({**{f: getattr(args, f) for f in args.__slots__}, "hc_sinkhorn_iters": 1})
    elif control == "swiglu-limit":
        a = type(args).from_dict({**{f: getattr(args, f) for f in args.__slots__}, "swiglu_limit": 0.05})
    elif control == "swap-nibbles":
        # the nibble order decides every code: layer 3's experts as if each byte's nibbles were swapped
        gu = list(gu)
        gu[3] = gu[3].unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    elif control == "grouped-o":
        wo = w["layers.1.attn.wo_a.weight"].view(a.o_groups, a.o_lora_rank, -1)
        w["layers.1.attn.wo_a.weight"] = wo.flip(0).reshape(-1, wo.shape[-1])
    ids = _ids(300, args.vocab_size)
    ours = _ours(a, w, (gu, dn), ids)
    with torch.no_grad():
        theirs = ref(ids[None]).logits[0]
    assert (ours - theirs).abs().max() > FP32_THRESHOLDS.max_abs * 10, control


def test_yarn_frequencies_are_transformers(pair):
    args, _, _, ref = pair
    rot = ref.model.rotary_emb
    assert torch.allclose(ds4.inv_freq(args, compressed=True), rot.compress_inv_freq, rtol=1e-6, atol=0)
    assert torch.allclose(ds4.inv_freq(args, compressed=False), rot.main_inv_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(rot.compress_inv_freq, 1.0 / (160000 ** (torch.arange(0, 8, 2) / 8)))


def test_unknown_compress_ratio_is_one_sentence():
    with pytest.raises(ValueError, match="compress ratios \\[16\\]"):
        ds4.DeepseekV4Args.from_dict(
            dict(
                vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, head_dim=8,
                qk_rope_head_dim=4, q_lora_rank=8, o_groups=1, o_lora_rank=8, index_n_heads=1,
                index_head_dim=8, index_topk=1, sliding_window=4, n_routed_experts=2,
                num_experts_per_tok=1, moe_intermediate_size=8, num_hash_layers=0, compress_ratios=[16],
            )
        )  # fmt: skip


def test_mxfp4_experts_repack_into_one_page_aligned_block_each(tmp_path):
    from expertstream.formats.expert_block import ALIGN, ExpertLayout

    snap = Snapshot(write_synthetic_ds4(tmp_path / "q", "ds4-tiny", seed=2))
    args = ds4.DeepseekV4Args.from_dict(snap.config)
    layout = ExpertLayout.for_format("mxfp4", args.hidden_size, args.moe_intermediate_size)
    assert layout.block_bytes % ALIGN == 0 and layout.block_bytes >= layout.payload_bytes
    assert ExpertLayout.from_json(layout.to_json()) == layout
    gate_up, down = ds4.dense_experts(snap, args)
    x = "layers.2.ffn.experts.5"
    tensors = {}
    for proj, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        tensors[f"{proj}.weight"] = snap.read(f"{x}.{w}.weight")
        tensors[f"{proj}.weight_scale"] = snap.read(f"{x}.{w}.scale")
    block = torch.frombuffer(bytearray(layout.pack(tensors)), dtype=torch.uint8)
    g, u, d = layout.dequantize(block, None)
    i = args.moe_intermediate_size
    assert (
        torch.equal(g, gate_up[2][5, :i]) and torch.equal(u, gate_up[2][5, i:]) and torch.equal(d, down[2][5])
    )
    # the published dimensions: 3,264 pages a block, 43 layers x 6 experts a token
    real = ExpertLayout.for_format("mxfp4", 4096, 2048)
    assert real.payload_bytes == real.block_bytes == 13_369_344 == 3264 * ALIGN
    assert 43 * 6 * real.block_bytes == 3_449_290_752  # expert bytes per token, 3.21 GiB
    assert ExpertLayout.for_format("nvfp4", 4096, 2048) == ExpertLayout.for_dims(4096, 2048)
    with pytest.raises(ValueError, match="unknown expert format"):
        ExpertLayout.for_format("int4", 64, 32)


def test_prefill_then_decode_steps_equal_the_whole_prompt(pair):
    # 125 prompt tokens then 11 steps: CSA windows close every 4 tokens, HCA's first at token 128, and the
    # sliding window drops keys on the way
    args, weights, experts, _ = pair
    ids = _ids(136, args.vocab_size)
    whole = _ours(args, weights, experts, ids)
    model = ds4.DeepseekV4Model(args, weights, DenseExperts(*experts, swiglu_limit=args.swiglu_limit))
    st = ds4.State.new(args)
    with torch.no_grad():
        steps = [model(ids[:125], st)] + [model(ids[t : t + 1], st) for t in range(125, 136)]
    got = model.logits(torch.cat(steps))
    assert (
        st.length == 136
        and st.tokens == ids.tolist()
        and st.layers[2].comp.entries.shape[0] == 1
        and st.layers[0].kv.shape[0] == 8
    )
    assert (got - whole).abs().max() <= FP32_THRESHOLDS.max_abs / 10
    assert (got[125:] - whole[124:-1]).abs().max() > 1  # the rows compared are the positions they claim


def test_transformers_reference_from_the_quantized_snapshot_is_transformers_own_conversion(tmp_path):
    # check's truth: transformers' model holding the FP8 + MXFP4 snapshot's dequantized weights under our
    # renames, equal to what transformers' own conversion mapping makes of the BF16 twin
    q = write_synthetic_ds4(tmp_path / "q", "ds4-tiny", seed=6)
    twin = write_synthetic_ds4(tmp_path / "t", "ds4-tiny", seed=6, dtype="bf16")
    ours = transformers_reference(Snapshot(q))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        twin, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    a, b = ours.state_dict(), theirs.state_dict()
    assert set(a) == set(b)
    assert all(torch.equal(a[k].float(), b[k].float()) for k in a)
    ids = _ids(140, ours.config.vocab_size)[None]
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


@pytest.mark.parametrize("start,stop", [(128, 256), (256, 300), (100, 200), (0, 300)])
def test_fp8_linear_rows_are_the_dequantized_rows(start, stop):
    # the grouped output projection takes each group's rows of an FP8 block-scaled Linear: aligned to the
    # 128-row blocks they keep the block scales, else each row gets its block's scales (1 x 128 blocks)
    from expertstream.formats import mxfp4
    from expertstream.kernels.fp8_gemv import dequantize_fp8_scaled
    from expertstream.models.base import Linear

    g = torch.Generator().manual_seed(start)
    q, scale = mxfp4.quantize_fp8_blocks_e8m0(torch.randn(300, 260, generator=g))
    lin = Linear(q, scale, block=(128, 128))
    part = lin.rows(start, stop)
    aligned = start % 128 == 0 and (stop % 128 == 0 or stop == 300)
    assert part.block == ((128, 128) if aligned else (1, 128))
    want = dequantize_fp8_scaled(q, scale, (128, 128))[start:stop]
    assert torch.equal(dequantize_fp8_scaled(part.weight, part.scale, part.block), want)
    x = torch.randn(3, 260, generator=g)
    torch.testing.assert_close(part(x), x @ want.T)
