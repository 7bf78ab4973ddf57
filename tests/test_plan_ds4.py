"""`plan` for DeepSeek-V4-Flash from its config.json alone: a token's expert bytes and the 8, 12 and 16 GiB
VRAM plans at the published dimensions (43 layers, 256 experts top-6, MXFP4 blocks)."""

import json
import math

import pytest

from expertstream.cli import main as cli_main
from expertstream.commands.plan import ConfigModel
from expertstream.memory_plan import GiB, MemoryPlanError
from expertstream.synth.deepseek_v4 import _QUANT, build_config

BLOCK = 13_369_344  # ExpertLayout.for_format("mxfp4", 4096, 2048)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    # the published dimensions and vocabulary (docs/deepseek-v4.md); synth's presets share every other field
    config = build_config("ds4-full-shape", 43, None, 129280, {"<|endoftext|>": 0, "<|im_end|>": 1})
    config["quantization_config"] = dict(_QUANT)
    path = tmp_path_factory.mktemp("ds4plan") / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_bytes_per_token_and_the_compressed_kv(published):
    model = ConfigModel.from_config(json.loads(published.read_text()))
    assert (model.num_layers, model.num_experts, model.block_bytes) == (43, 256, BLOCK)
    plan = model.memory_plan(int(16 * GiB * 0.9), 32768)
    # 21 CSA layers keep an entry per 4 tokens, 20 HCA layers per 128; BF16 keys of head_dim 512
    assert plan.kv == (21 * 8192 + 20 * 256) * 512 * 2
    assert plan.indexer_keys == 21 * 8192 * 128 * 2
    assert plan.embed_on_host


def test_the_8_12_16_gib_plans(published, capsys):
    model = ConfigModel.from_config(json.loads(published.read_text()))
    # 8 GiB at the default 0.9: the shipped weights and the BF16 head leave no room
    with pytest.raises(MemoryPlanError, match="7.20 GiB VRAM budget cannot hold"):
        model.memory_plan(int(8 * GiB * 0.9), 32768)
    tight = model.memory_plan(int(8 * GiB * 0.95), 32768)
    assert "head.weight" in tight.fp8  # the BF16 head goes FP8 before anything else
    plans = [model.memory_plan(int(g * GiB * 0.9), 32768) for g in (12, 16)]
    assert not plans[1].fp8 and 0 < plans[0].vram_cache_blocks < plans[1].vram_cache_blocks
    args = [str(published), "--gpu-memory-gb", "16", "--ram-cache-gb", "16", "--disk-gbps", "3",
            "--pcie-gbps", "25"]  # fmt: skip
    assert cli_main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert f"  {'routed experts':<44} {43 * 6 * BLOCK / 1e6:9.1f} MB" in out


def test_the_12_gib_plan_holds_the_model_as_the_engine_holds_it(published):
    # the CUDA engine keeps the shipped FP8 matrices FP8 (the block-scaled kernel) and the embedding in host
    # RAM, so under BF16 it holds no byte beyond what the plan counts (its F32 tensors shrink) and the
    # 12 GiB plan is the engine's own; dequantized, the weights alone would exceed the budget
    from expertstream.models import deepseek_v4 as ds4

    model = ConfigModel.from_config(json.loads(published.read_text()))
    inventory = {name: (shape, dtype) for name, (dtype, shape) in model.resident_spec().items()}
    assert ds4.dense_surplus(inventory, 2, "embed.weight") < 0
    budget = int(12 * GiB * 0.9)
    plan = model.memory_plan(budget, 32768)
    assert plan.vram_cache_blocks > 0
    fp8 = sum(math.prod(s) for s, d in inventory.values() if d == "F8_E4M3")
    assert plan.resident + fp8 > budget  # one more byte a weight (BF16) would not fit


def test_the_cpu_share_times_the_kernel_on_mxfp4_blocks(published, monkeypatch):
    """`plan`'s CPU share estimate times the CPU kernel on the model's own blocks (MXFP4 here, not NVFP4)."""
    from argparse import Namespace

    from expertstream.commands import plan
    from expertstream.kernels import cpu_moe

    seen = []

    def layer_rate(rows, layout, k, threads):
        seen.append((layout.fmt, layout.block_bytes, rows.shape[1], k))
        return 12.5

    monkeypatch.setattr(cpu_moe, "library", lambda: object())
    monkeypatch.setattr(cpu_moe, "layer_rate", layer_rate)
    model = ConfigModel.from_config(json.loads(published.read_text()))
    args = Namespace(cpu_gbps=None, cpu_cores=None, mem_gbps=None)
    assert plan.cpu_rate(args, model, 2) == (12.5, "measured on 2 threads here")
    assert seen == [("mxfp4", BLOCK, BLOCK, 6)]
