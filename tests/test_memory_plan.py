import pytest
import torch

from expertstream.memory_plan import PREFILL_TARGET, GiB, MemoryPlanError, gpu_budget, plan_memory
from expertstream.workdir.inventory import resident_spec

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
        indexer_n_heads=4,
        ple_embed_dim=2560,
        heads_per_ngram=8,
    )


def real_resident():
    """The shipped model's resident tensors, as setup expects them (inventory.resident_spec), BF16."""
    return {name: (shape, dtype) for name, (dtype, shape) in resident_spec(real_text_config()).items()}


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
    # prompts run layer by layer in spans, each fetching its experts once per layer: the budget of a
    # 1,024-token piece-major workspace buys 256-token pieces in 5,888-token spans (the streams updated in
    # place, the shared expert and the routed sums' cast run piece by piece), and the plan says what a
    # full-context prompt costs
    assert (plan.prefill_piece, plan.prefill_span) == (256, 5888)
    assert "~6x the expert bytes of one pass" in plan.describe()


def test_fp8_buys_the_target_prefill_piece_before_bf16_is_kept():
    # the default utilization (0.9 x 8 GiB): the DeltaNet matrices alone would leave 128-token pieces
    tight = plan_memory(real_text_config(), real_resident(), BLOCK, int(7.2 * GiB), 32768)
    assert "lm_head.weight" not in tight.fp8 and any("self_attn.o_proj" in n for n in tight.fp8)
    # that budget (a 1,024-token piece-major workspace) is split into the longest span: 5,888 tokens
    assert tight.prefill_span == 5888 and tight.prefill_span % tight.prefill_piece == 0
    # the expert kernels of a span run after its attention, in the piece's workspace: 768 tokens a launch
    assert tight.prefill_chunk == 768 and tight.prefill_chunk % tight.prefill_piece == 0
    assert tight.prefill_span > PREFILL_TARGET
    # a 4k context at 8 GiB converts fewer matrices
    short = plan_memory(real_text_config(), real_resident(), BLOCK, 8 * GiB, 4096)
    assert short.prefill_span >= 2048 and len(short.fp8) < len(tight.fp8)


def test_a_roomy_plan_runs_whole_contexts_in_one_span():
    plan = plan_memory(real_text_config(), real_resident(), BLOCK, 24 * GiB, 4096)
    assert plan.prefill_span == 4096 and "spans" not in " ".join(plan.notes)


def test_larger_budget_keeps_bf16_and_grows_the_cache():
    small = plan_memory(real_text_config(), real_resident(), BLOCK, 8 * GiB, 32768)
    big = plan_memory(real_text_config(), real_resident(), BLOCK, 24 * GiB, 32768)
    assert big.fp8 == [] and big.vram_cache_blocks > small.vram_cache_blocks + 3000
    assert big.prefill_span >= small.prefill_span


def test_the_cache_never_outgrows_the_models_experts():
    # 160 GiB holds every one of the 48 x 512 blocks (~63 GiB): the cache takes that many rows, no more
    huge = plan_memory(real_text_config(), real_resident(), BLOCK, 160 * GiB, 32768)
    assert huge.vram_cache_blocks == 48 * 512
    assert "every expert fits in the VRAM cache" in huge.describe()
    roomy = plan_memory(real_text_config(), real_resident(), BLOCK, 24 * GiB, 32768)
    assert roomy.vram_cache_blocks < 48 * 512 and "every expert fits" not in roomy.describe()


def test_budget_too_small_names_what_is_needed():
    with pytest.raises(MemoryPlanError, match=r"needs at least \d+\.\d+ GiB"):
        plan_memory(real_text_config(), real_resident(), BLOCK, 5 * GiB, 32768)
    # the same budget fits a short context? no: weights alone exceed 5 GiB even in FP8
    with pytest.raises(MemoryPlanError):
        plan_memory(real_text_config(), real_resident(), BLOCK, 5 * GiB, 1024)


def test_gpu_budget_is_the_flag_or_a_share_of_the_total_and_refuses_what_the_gpu_cannot_give():
    free, total = 20 * GiB, 24 * GiB
    assert gpu_budget(8, 0.9, free, total) == int(8 * GiB * 0.9)
    assert gpu_budget(None, 0.8, free, total) == int(total * 0.8)  # vLLM's meaning: of the total
    with pytest.raises(ValueError, match=r"utilization 0.9 of 24.0 GiB = 21.6 GiB, but only 20.0 GiB"):
        gpu_budget(None, 0.9, free, total)  # another process holds more than the 10 % left
    with pytest.raises(ValueError, match="exceeds the GPU's 24.0 GiB"):
        gpu_budget(32, 0.9, free, total)
    with pytest.raises(ValueError, match=r"22.8 GiB, but only 20.0 GiB of the GPU's 24.0 GiB are free"):
        gpu_budget(24, 0.95, free, total)


@pytest.mark.gpu  # the allocator's limit needs a GPU
def test_the_engine_enforces_its_budget_on_cuda(tiny_workdir):
    from expertstream.config import EngineConfig
    from expertstream.runtime.engine import Engine

    eng = Engine(EngineConfig(model=str(tiny_workdir), device="cuda", gpu_memory_gb=1, max_model_len=512))
    try:
        torch.empty(GiB // 8, dtype=torch.uint8, device="cuda")  # inside the 0.9 GiB budget: allowed
        with pytest.raises(torch.cuda.OutOfMemoryError):  # past it: refused, though the GPU has room
            torch.empty(GiB, dtype=torch.uint8, device="cuda")
    finally:
        del eng
        torch.cuda.set_per_process_memory_fraction(1.0)
