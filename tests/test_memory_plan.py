import pytest

from expertstream.memory_plan import GiB, MemoryPlanError, plan_memory

BLOCK = 2_764_800


def real_text_config():
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    return dict(
        hidden_size=2560,
        num_hidden_layers=48,
        layer_types=types,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=640,
        shared_expert_intermediate_size=640,
        num_attention_heads=24,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        hc_count=4,
        hc_lowrank=320,
        ple_layer_ids=[2],
        ngram_size=3,
        ple_conv_kernel_size=4,
        indexer_kv_heads=1,
        indexer_head_dim=128,
        indexer_compress_ratio=4,
        vocab_size=248320,
    )


def real_resident():
    """The shipped model's resident tensors (checkpoint doc section 4), BF16."""
    inv = {"embed_tokens.weight": ((248320, 2560), "BF16"), "lm_head.weight": ((248320, 2560), "BF16")}
    hc = {
        "hc_norm.weight": (10240,),
        "input_mix_weight_down.weight": (320, 10240),
        "input_mix_weight_up.weight": (10240, 320),
        "block_inject_weight.weight": (4, 10240),
    }
    for n, s in hc.items():
        if n != "block_inject_weight.weight":
            inv[f"hyper_connection_mixer.{n}"] = (s, "BF16")
    for L, t in enumerate(real_text_config()["layer_types"]):
        p = f"layers.{L}."
        for mod in ("attn_hyper_connection", "mlp_hyper_connection"):
            for n, s in hc.items():
                inv[f"{p}{mod}.{n}"] = (s, "BF16")
        inv[p + "mlp.gate.weight"] = ((512, 2560), "BF16")
        inv[p + "mlp.shared_expert.gate_proj.weight"] = ((640, 2560), "BF16")
        inv[p + "mlp.shared_expert.up_proj.weight"] = ((640, 2560), "BF16")
        inv[p + "mlp.shared_expert.down_proj.weight"] = ((2560, 640), "BF16")
        inv[p + "mlp.shared_expert_gate.weight"] = ((1, 2560), "BF16")
        if t == "linear_attention":
            inv[p + "linear_attn.in_proj_qkv.weight"] = ((10240, 2560), "BF16")
            inv[p + "linear_attn.in_proj_z.weight"] = ((6144, 2560), "BF16")
            inv[p + "linear_attn.in_proj_b.weight"] = ((48, 2560), "BF16")
            inv[p + "linear_attn.in_proj_a.weight"] = ((48, 2560), "BF16")
            inv[p + "linear_attn.out_proj.weight"] = ((2560, 6144), "BF16")
            inv[p + "linear_attn.conv1d.weight"] = ((10240, 1, 4), "BF16")
        else:
            inv[p + "self_attn.q_proj.weight"] = ((12288, 2560), "BF16")
            inv[p + "self_attn.k_proj.weight"] = ((512, 2560), "BF16")
            inv[p + "self_attn.v_proj.weight"] = ((512, 2560), "BF16")
            inv[p + "self_attn.o_proj.weight"] = ((2560, 6144), "BF16")
            inv[p + "self_attn.indexer.index_qk_proj.weight"] = ((640, 2560), "BF16")
    inv["layers.1.ple.key_proj.weight"] = ((10240, 2560), "BF16")
    inv["layers.1.ple.value_proj.weight"] = ((2560, 2560), "BF16")
    return inv


def test_8gib_plan_holds_the_real_model_with_32k_context():
    plan = plan_memory(real_text_config(), real_resident(), BLOCK, 8 * GiB, 32768)
    # the three big DeltaNet matrices of all 36 layers go FP8, nothing else needs to
    assert len(plan.fp8) == 108 and all("linear_attn" in n for n in plan.fp8)
    assert 5.9 * GiB < plan.resident < 6.3 * GiB  # ~6.1 GiB as measured by the seed engine
    assert plan.kv == 12 * 2 * 2 * 256 * 2 * 32768
    assert plan.embed_on_host and plan.vram_cache_blocks >= 0
    total = (
        plan.resident
        + plan.state
        + plan.kv
        + plan.indexer_keys
        + plan.slots
        + plan.decode_workspace
        + plan.prefill_workspace
        + plan.reserve
        + plan.vram_cache
    )
    assert total <= plan.budget
    assert "VRAM plan" in plan.describe()


def test_larger_budget_keeps_bf16_and_grows_the_cache():
    small = plan_memory(real_text_config(), real_resident(), BLOCK, 8 * GiB, 32768)
    big = plan_memory(real_text_config(), real_resident(), BLOCK, 24 * GiB, 32768)
    assert big.fp8 == [] and big.vram_cache_blocks > small.vram_cache_blocks + 3000
    assert big.prefill_piece >= small.prefill_piece


def test_budget_too_small_names_what_is_needed():
    with pytest.raises(MemoryPlanError, match=r"needs at least \d+\.\d+ GiB"):
        plan_memory(real_text_config(), real_resident(), BLOCK, 5 * GiB, 32768)
    # the same budget fits a short context? no: weights alone exceed 5 GiB even in FP8
    with pytest.raises(MemoryPlanError):
        plan_memory(real_text_config(), real_resident(), BLOCK, 5 * GiB, 1024)
