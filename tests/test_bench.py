"""The CPU-testable parts of `expertstream bench decode|prefill`: plans, tables, arguments, clear refusals."""

import argparse
import dataclasses
import json
import shutil
import types

import pytest
import torch

from expertstream.bench import cli as bench
from expertstream.bench import model as full_model
from expertstream.bench import runtime as bench_runtime
from expertstream.bench.baseline import baseline_disk_needed, baseline_table, max_memory
from expertstream.bench.model import bench_layers, layers_that_fit
from expertstream.bench.prefill import plan_prefill, prefill_table
from expertstream.bench.runtime import busy_ms, decode_regimes, decode_table, profile_tokens
from expertstream.bench.split_report import spread
from expertstream.config import EngineConfig
from expertstream.workdir.workdir import Workdir


def parse(argv):
    p = argparse.ArgumentParser()
    bench.configure_parser(p)
    return p.parse_args(argv)


def test_arguments_of_the_new_modes():
    a = parse(["prefill", "--prompts", "2451", "32768", "--baseline", "--no-speculation"])
    assert (a.what, a.prompts, a.baseline, a.no_speculation, a.baseline_layers) == (
        "prefill",
        [2451, 32768],
        True,
        True,
        2,
    )
    assert parse(["decode"]).prompts is None and not parse(["decode"]).baseline
    assert parse(["decode", "--profile", "/tmp/p"]).profile.name == "p"


def test_layers_as_many_as_the_disk_and_ram_allow(tmp_path, monkeypatch):
    gb = 10**9
    # 1.4 GB of experts a layer: 3.08 GB of disk each; 0.9 x 100 GB - 2 GB leaves room for 28 layers
    assert layers_that_fit(100 * gb, 1000 * gb, int(1.4 * gb)) == (28, 357)
    assert layers_that_fit(100 * gb, 20 * gb, int(1.4 * gb)) == (28, 7)  # half of 20 GB of RAM pinned
    assert layers_that_fit(gb, gb, int(1.4 * gb)) == (0, 0)
    # the refusal's figure is the same arithmetic: 28 layers need at most 100 GB, 29 more
    need = [full_model.disk_needed(n, int(1.4 * gb)) for n in (28, 29)]
    assert need[0] <= 100 * gb < need[1]
    disk = [10**6 * gb]  # what shutil.disk_usage says is free
    monkeypatch.setattr(shutil, "disk_usage", lambda p: types.SimpleNamespace(free=disk[0]))
    monkeypatch.setattr(full_model, "host_ram_bytes", lambda: 10**6 * gb)
    assert bench_layers(tmp_path, 0) == 48  # never more than the real model
    assert bench_layers(tmp_path, 3) == 3  # an explicit --layers is taken as it is
    disk[0] = 10 * gb  # room for 2 layers
    assert bench_layers(tmp_path, 0) == 2
    with pytest.raises(SystemExit, match="a 5-layer full-shape bench model needs ~20 GB free"):
        bench_layers(tmp_path, 5)
    # a model already made is reused, by --layers 0 too when it has more layers than fit now
    (tmp_path / "full-5-wd").mkdir()
    (tmp_path / "full-5-wd" / "manifest.json").write_text("{}")
    (tmp_path / "full-7-wd").mkdir()  # unfinished: no manifest, not counted
    assert bench_layers(tmp_path, 5) == 5 and bench_layers(tmp_path, 0) == 5
    disk[0] = gb  # not even one layer fits: refused before anything is written
    with pytest.raises(SystemExit, match="a 7-layer"):
        bench_layers(tmp_path, 7)
    shutil.rmtree(tmp_path / "full-5-wd")
    with pytest.raises(SystemExit, match="a 1-layer full-shape bench model needs ~6 GB free"):
        bench_layers(tmp_path, 0)


def test_the_baseline_keeps_its_disk_room_and_is_refused_before_the_regimes(tmp_path, monkeypatch):
    gb = 10**9
    layer = full_model.full_shape_layer_bytes()  # 1.42 GB
    need = baseline_disk_needed(tmp_path, 2)
    # its snapshot and its whole bf16 twin, 10 % more for dense weights, 2 GB spare: ~16 GB for 2 layers
    assert need == pytest.approx(2 * layer * (1 + 32 / 9) * 1.1 + 2 * gb)
    (tmp_path / "full-2").mkdir()
    (tmp_path / "full-2" / "config.json").write_text("{}")  # a snapshot already made: only the offload
    assert baseline_disk_needed(tmp_path, 2) == pytest.approx(2 * layer * 32 / 9 * 1.1 + 2 * gb)
    disk = [30 * gb]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: types.SimpleNamespace(free=disk[0]))
    monkeypatch.setattr(full_model, "host_ram_bytes", lambda: 10**6 * gb)
    assert bench_layers(tmp_path / "a", 0) == 8  # (0.9 x 30 GB - 2 GB) / 3.1 GB a layer
    assert bench_layers(tmp_path / "b", 0, reserve=need) == 3  # (0.9 x (30 - 16.2) GB - 2 GB) / 3.1 GB
    # a model made earlier that left no room: refused before any regime runs, in one sentence (the
    # 2-layer snapshot made above: only the offload folder is asked for)
    made = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_runtime, "ensure_model", lambda root, n: made.append(n))
    (tmp_path / "full-19-wd").mkdir()
    (tmp_path / "full-19-wd" / "manifest.json").write_text("{}")
    disk[0] = 5 * gb
    args = parse(["decode", "--workdir", str(tmp_path), "--baseline"])
    refusal = "--baseline needs ~13 GB free .* 5.0 GB are free beside the 19-layer model"
    with pytest.raises(SystemExit, match=refusal):
        bench_runtime.bench_model(args, "decode", 4096)
    assert made == [19]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("what", ["decode", "prefill"])
def test_without_cuda_the_gpu_benches_refuse_clearly(what, tmp_path):
    with pytest.raises(SystemExit, match=f"bench {what} needs a CUDA GPU"):
        bench.main(parse([what, "--workdir", str(tmp_path)]))
    assert not any(tmp_path.iterdir())  # refused before synthesising anything


def test_prefill_plan_counts_spans_passes_and_bytes():
    # 32768 tokens in 4096-token spans (256-token pieces: they do not change the bytes), 76 slots (38 per
    # pass), 512 experts, top-10
    p = plan_prefill(32768, 256, 4096, 76, 512, 10, 100)
    assert (p.spans, p.group, p.max_passes_per_layer) == (8, 38, 8 * 14)
    assert p.max_expert_bytes_per_layer == 8 * 512 * 100
    assert plan_prefill(32768, 4096, 4096, 76, 512, 10, 100) == dataclasses.replace(p, piece=4096)
    # a short last span routes to fewer distinct experts: 2451 = 2048 + 403; 10 tokens -> 100 experts
    q = plan_prefill(2451, 256, 2048, 76, 512, 10, 1)
    assert q.spans == 2 and q.max_passes_per_layer == 28
    assert plan_prefill(10, 256, 4096, 76, 512, 10, 1).max_passes_per_layer == 3


def decode_result(ms, tokens, **kw):
    r = dict(
        ms_per_token=ms,
        tokens=tokens,
        disk_bytes_per_token=0.0,
        pcie_bytes_per_token=0.0,
        vram_hit_rate=1.0,
        ram_hit_rate=0.0,
        stall_ms_per_token=0.0,
        sync_ms_per_token=1.5,
        bank_host_ms_per_token=0.25,
        guess_host_ms_per_token=0.1,
        outside_bank_ms_per_token=3.0,
        spec_hit_rate=0.75,
        spec_wasted_bytes_per_token=2e6,
        syncs_per_token=4.0,
        all_syncs_per_token=9.5,
        peak_gib=6.25,
    )
    return r | kw


def test_decode_table_bound_efficiency_and_token_check():
    results = {
        "vram": decode_result(10.0, [1, 2]),
        "disk": decode_result(40.0, [1, 3], disk_bytes_per_token=60e6, pcie_bytes_per_token=110e6),
    }
    table = decode_table(results, disk_gbps=2.0, pcie_gbps=55.0, layers=4)
    assert results["disk"]["bound_ms"] == pytest.approx(30.0) and results["disk"]["efficiency"] == 0.75
    rows = table.strip().splitlines()
    assert len(rows) == 8 and "guess hit" in rows[0] and "bank syncs/token" in rows[0]
    # the engine's own disk rate: 60 MB in 40 ms, under the 2 GB/s probe (no flag)
    assert rows[-3] == "Disk rate the engine reached (disk bytes / wall time, GB/s): disk 1.50."
    assert (
        rows[-1] == "Greedy tokens identical in every regime (2 tokens, against `vram`): NO (`disk` differ)."
    )
    assert "| 0.00 | 1.50 | 0.25 | 0.10 | 3.00 |" in rows[2]  # stall, sync wait, bank host, guesses, outside
    assert "| 75% | 2.0 | 4.0 | 9.5 | 6.25 | yes |" in rows[2] and "| NO |" in rows[3]  # no margins recorded


def test_decode_table_says_where_tokens_part_and_the_margin_there():
    results = {
        "vram": decode_result(10.0, [5, 7, 9, 4], margins=[1.5, 0.02, 0.7, 0.3]),
        "ram": decode_result(20.0, [5, 8, 2, 2], margins=[1.5, 0.01, 0.2, 0.4]),
        "disk": decode_result(40.0, [5, 7, 9, 4], margins=[1.5, 0.02, 0.7, 0.3]),
    }
    rows = decode_table(results, disk_gbps=2.0, pcie_gbps=55.0, layers=4).strip().splitlines()
    assert "| NO from token 2 (vram top-2 margin 0.02) |" in rows[3] and "| yes |" in rows[4]
    del results["ram"]
    table = decode_table(results, disk_gbps=2.0, pcie_gbps=55.0, layers=4)
    assert table.endswith("Greedy tokens identical in every regime (4 tokens, against `vram`): yes.\n")


def test_decode_table_hardware_bound_from_the_profile():
    busy = {"kernel_ms_per_token": 2.0, "copy_ms_per_token": 0.0}
    results = {
        "vram": decode_result(10.0, [1, 2], profiled=busy),
        "ram": decode_result(8.0, [1, 2], pcie_bytes_per_token=110e6, profiled=busy),
    }
    table = decode_table(results, disk_gbps=2.0, pcie_gbps=55.0, layers=4)
    assert results["vram"]["hw_efficiency"] == pytest.approx(0.2)  # 2 ms of kernels in a 10 ms token
    assert results["ram"]["hw_bound_ms"] == pytest.approx(2.0) and results["ram"]["hw_efficiency"] == 0.25
    assert "vram 2.00 / 0.00 ms, 0.20; ram 2.00 / 0.00 ms, 0.25." in table


def test_prefill_table_and_oom_row():
    plan = {"piece": 256, "span": 4096, "max_passes_per_layer": 112}
    ok = dict(
        prompt=32768,
        oom=False,
        seconds=4.0,
        disk_bytes=8e9,
        pcie_bytes=44e9,
        passes_per_layer=100.0,
        stall_seconds=1.0,
        peak_gib=6.5,
        plan=plan,
    )
    # the compute floor: the same prompt with every expert in VRAM (no disk, no PCIe bytes)
    floor = ok | dict(seconds=2.5, disk_bytes=0.0, pcie_bytes=0.0, next_tokens=[7])
    fast_ram = ok | dict(seconds=3.0, disk_bytes=0.0, pcie_bytes=55e9, next_tokens=[7])  # 1.0 s of PCIe
    ok["next_tokens"] = [7, 9]  # two runs that disagreed: not the same
    results = {
        "vram/32768": floor,
        "disk/32768": ok,
        "ram/32768": fast_ram,
        "ram/2451": {"prompt": 2451, "oom": True, "plan": plan},
        "disk/2451": {"prompt": 2451, "oom": False, "skipped": True, "estimate_s": 741.0,
                      "plan": plan | {"spans": 20, "max_expert_bytes_per_layer": 26e9}},
    }  # fmt: skip
    table = prefill_table(results, disk_gbps=2.0, pcie_gbps=55.0, layers=4, budget_gib=7.2)
    assert "not run: 20 spans fetch up to 26 GB of experts per layer, >= 741 s" in table
    assert ok["bound_s"] == pytest.approx(4.0) and ok["efficiency"] == pytest.approx(1.0)  # disk-bound
    assert fast_ram["bound_s"] == pytest.approx(2.5) and fast_ram["efficiency"] == pytest.approx(2.5 / 3)
    assert floor["efficiency"] == pytest.approx(1.0)
    assert "| 100 (112) |" in table and "6.50 (7.20)" in table and "out of VRAM budget" in table
    assert "| 0.83 | yes |" in table and "| 1.00 | no |" in table  # ram agrees with vram; disk's runs did not
    assert "engine reached (disk bytes / wall time, GB/s): disk/32768 2.00." in table
    # an engine faster than the probe is named: the drive beat its probe, not the bound
    table = prefill_table(results, disk_gbps=1.6, pcie_gbps=55.0, layers=4, budget_gib=7.2)
    assert "faster than the 1.60 GB/s probe in disk/32768" in table and ok["efficiency"] > 1


def test_baseline_memory_map_and_table():
    assert max_memory(8.0, 3 * 2**30) == {0: "8.0GiB", "cpu": "3.000GiB"}
    assert max_memory(None, 2**30) == {"cpu": "1.000GiB"}
    base = {"layers": 2, "prompt": 1, "seconds": 0.2, "placement": {"0": 1, "disk": 1}}
    table = baseline_table(base, {"ram": 2.0}, "decode")
    assert "100.0 ms per layer" in table and "| ram | 2.00 | 100.0 | 50.0x |" in table


def test_baseline_runs_offloaded_on_cpu_and_disk(tiny_snapshot):
    pytest.importorskip("accelerate")
    from expertstream.bench.baseline import time_offloaded

    out = time_offloaded(tiny_snapshot, max_memory(None, 2**20), prompt=4, reps=1)  # layer 0 in RAM
    assert out["layers"] == 4 and out["seconds"] > 0 and "disk" in out["placement"]


def test_profile_writes_the_op_table_and_a_trace(tmp_path):
    a = torch.randn(64, 64)
    busy = profile_tokens(lambda: a @ a, tmp_path / "prof" / "vram")
    assert "aten::mm" in (tmp_path / "prof" / "vram.txt").read_text()
    assert json.loads((tmp_path / "prof" / "vram.json").read_text())["traceEvents"]
    assert busy["kernel_ms_per_token"] >= 0 and busy["copy_ms_per_token"] >= 0  # no GPU here: zero


def test_busy_time_counts_overlaps_once():
    assert busy_ms([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert busy_ms([]) == 0


def test_the_real_plans_prefill_span_is_what_the_bench_uses():
    """The 48-layer model under 8 GiB with a 32k context runs prompts in 5,888-token spans of 256-token
    pieces (the bench's 4-layer model would allow far longer), and each span fetches its experts once."""
    import collections
    from types import SimpleNamespace

    from expertstream.bench.prefill import plan_prefill
    from expertstream.bench.runtime import real_model_plan
    from expertstream.formats.expert_block import ExpertLayout
    from expertstream.synth.synth import build_config

    tc = build_config("full-shape", None, None, 1024, collections.defaultdict(lambda: 7))["text_config"]
    wd = SimpleNamespace(text_config=tc, layout=ExpertLayout.for_dims(2560, 640))
    small, big = real_model_plan(wd, 8.0, 32768), real_model_plan(wd, 24.0, 32768)
    assert (small.prefill_piece, small.prefill_span) == (256, 5888)
    assert big.prefill_span > 4 * small.prefill_span
    block = wd.layout.block_bytes
    one = plan_prefill(2451, 4096, 4096, 2, 512, 10, block).max_expert_bytes_per_layer
    # a 2,451-token prompt fits one span: each expert once per layer (three times with 1,024-token pieces)
    assert plan_prefill(2451, 256, 5888, 2, 512, 10, block).max_expert_bytes_per_layer == one
    assert plan_prefill(32768, 256, 5888, 2, 512, 10, block).max_expert_bytes_per_layer == 6 * one


def test_regimes_flag_picks_regimes_by_slug_and_names_unknown_ones():
    import argparse

    from expertstream.bench.cli import chosen

    regimes = {"vram": 1, "vram eager": 2, "disk, 24 GiB VRAM": 3}
    assert chosen(argparse.Namespace(regimes=None), regimes) == regimes
    picked = chosen(argparse.Namespace(regimes=["disk_24_GiB_VRAM", "vram"]), regimes)
    assert list(picked) == ["vram", "disk, 24 GiB VRAM"]
    with pytest.raises(SystemExit, match="vram_eager"):
        chosen(argparse.Namespace(regimes=["ram"]), regimes)


def test_decode_regimes_stage_in_ram_only_on_top_of_the_cache_share(tiny_workdir):
    wd = Workdir(tiny_workdir)
    base = EngineConfig(model=str(tiny_workdir), gpu_memory_gb=8.0, max_model_len=4096)
    regimes, info = decode_regimes(wd, base, stage_guesses=2)
    every = wd.num_layers * wd.num_experts
    assert regimes["vram"][1] == every and regimes["vram eager"][0].enforce_eager
    # the floor's budget holds every block on top of the 8 GiB (a 19-layer model's 25 GiB did not fit in 8)
    expert_gib = every * wd.layout.block_bytes / 2**30
    for name in ("vram", "vram eager"):
        assert regimes[name][0].gpu_memory_gb == pytest.approx(8.0 + expert_gib)
    assert all(regimes[n][0].gpu_memory_gb == 8.0 for n in ("ram", "ram unstaged", "disk"))
    assert info["staged"] == 2 and regimes["ram"][0].stage_guesses == 2
    assert regimes["ram"][1] == info["vram_blocks"] + 4 and regimes["ram unstaged"][0].stage_guesses == 0
    assert regimes["disk"][0].ram_cache_gb < regimes["ram"][0].ram_cache_gb
    # the CPU share regime: chosen at start by default, or the bench's --cpu-moe-share; only it has one
    assert regimes["ram, CPU share"][0].cpu_moe_share == -1.0 and regimes["ram"][0].cpu_moe_share == 0
    by_hand, _ = decode_regimes(wd, base, stage_guesses=2, cpu_moe_share=0.3)
    assert by_hand["ram, CPU share"][0].cpu_moe_share == 0.3


def test_decoding_engine_starts_past_its_warm_up(tiny_workdir):
    """The decode scripts' engine: caches warmed, a 16-token prompt and 6 tokens decoded, the next token
    ready (the scripts then time the steady state)."""
    from expertstream.bench.runtime import decoding_engine
    from expertstream.config import EngineConfig

    eng, state, tok = decoding_engine(EngineConfig(model=str(tiny_workdir), device="cpu"), 0)
    try:
        assert state.pos == 16 + 6 and 0 <= tok < eng.args.vocab_size
        assert eng.store.cached_blocks == min(
            eng.store.capacity, eng.workdir.num_layers * eng.workdir.num_experts
        )
    finally:
        eng.close()


def test_checksum_note_gives_the_cost_per_block_and_its_share_of_a_disk_bound_token():
    from expertstream.bench.runtime import checksum_note

    # 100 blocks of 2,764,800 B checked in 50 ms of CPU: 0.5 ms each; the drive delivers one every 0.5 ms at
    # 5.5296 GB/s, so one thread would need 100 % of a disk-bound token, 16 readers 6.25 %
    results = {
        "disk": {"blocks_checked": 100, "checksum_seconds": 0.08, "checksum_cpu_seconds": 0.05},
        "vram": {},
    }
    note = checksum_note(results, disk_gbps=5.5296, block=2_764_800, io_threads=16)
    assert "0.500 ms of CPU per 2,764,800 B block (5.5 GB/s per reader thread; 0.800 ms wall" in note
    assert "6.25% with the 16 readers checking in parallel, 100.00% if one thread checked them all" in note
    assert checksum_note({"vram": {}}, 5.0, 2_764_800, 16) == ""


def test_decode_table_bound_takes_the_cpu_share():
    results = {
        "vram": decode_result(2.0, [1, 2]),
        "ram unstaged": decode_result(12.0, [1, 2], pcie_bytes_per_token=440e6),
        # 6 of 10 experts over the bus (264 MB: 4.8 ms at 55 GB/s), 4 on the CPU (176 MB: 8.8 ms at 20 GB/s)
        "ram, CPU share": decode_result(
            10.0, [1, 2], pcie_bytes_per_token=264e6, cpu_bytes_per_token=176e6, cpu_gbps=20.0, cpu_experts=4
        ),
    }
    table = decode_table(results, disk_gbps=2.0, pcie_gbps=55.0, layers=4)
    assert results["ram unstaged"]["bound_ms"] == pytest.approx(8.0)
    assert results["ram, CPU share"]["bound_ms"] == pytest.approx(8.8)  # the CPU's side is the bound
    assert "4 routed experts a layer on the CPU, 176.0 MB/token at 20.0 GB/s" in table
    assert "bound terms PCIe 4.80 ms, CPU 8.80 ms, GPU 2.00 ms; 1.20x `ram unstaged`." in table


def test_the_cpu_share_regime_is_ram_with_a_measured_share_and_k_copy_rows(tiny_workdir):
    wd = Workdir(tiny_workdir)
    base = EngineConfig(model=str(tiny_workdir), gpu_memory_gb=8.0, max_model_len=4096)
    regimes, _ = decode_regimes(wd, base, stage_guesses=2)
    share, without = regimes["ram, CPU share"], regimes["ram"]
    assert share[0].cpu_moe_share == -1.0 and without[0].cpu_moe_share == 0.0
    assert dataclasses.replace(share[0], cpu_moe_share=0.0) == without[0]
    assert share[1] == without[1] + wd.text_config["num_experts_per_tok"]  # the GPU share's copy rows


def test_serve_table_says_why_a_background_task_failed():
    from expertstream.bench.serve import table

    rows = [dict(turn="first message", tasks="alone", prompt_tokens=10, ttft=1.0, tokens=4, tps=3.0)]
    tasks = [("title", 2.0, 16), ("tags", 0.5, "failed: generation failed: CUDA out of memory")]
    text = table(rows, tasks, [], tools_tokens=10)
    assert "title 2.0 s (16 tokens), tags 0.5 s (failed: generation failed: CUDA out of memory)" in text


def test_serve_throughput_table_gives_the_vram_columns_where_measured():
    from expertstream.bench.serve import table

    row = dict(n=2, tokens=64, tps=20.0, blocks_per_step=30, mb_per_step=80.0, bus_mb_per_step=9.0,
               disk_mb_per_step=1.0, reserved_gib=3.5, graphs_mib=42.0)  # fmt: skip
    text = table([], [], [row, dict(row, n=4, reserved_gib=None, graphs_mib=None)], tools_tokens=10)
    assert "| 2 | 64 | 20.0 | 30 | 80.0 | 9.0 | 1.0 | 3.50 | 42 |" in text
    assert "| 4 | 64 | 20.0 | 30 | 80.0 | 9.0 | 1.0 | - | - |" in text


def test_a_spread_is_mean_median_p90_and_max_in_ms():
    assert spread([0.003, 0.001, 0.010, 0.002]) == pytest.approx([4.0, 3.0, 10.0, 10.0])


def test_the_cpu_share_note_breaks_a_split_layer_down_and_models_its_reach():
    # d = 1.6 / 4 = 0.4 ms; 10 blocks of 2.5 MB over a 50 GB/s bus 0.5 ms; 4 on the CPU at 40 GB/s 0.25 ms
    # against the bus's 6 in 0.3 ms
    split = dict(
        cpu_bytes_per_token=40e6, cpu_gbps=45.0, cpu_experts=4, k=10, block_bytes=2_500_000,
        payload_bytes=2_500_000, cpu_gbps_in_place=40.0, cpu_threads=14, split_layers_per_token=4.0,
        split_kernel_ms=1.0, split_gpu_share_ms=1.5, split_gpu_idle_ms=0.3, gpu_ms_per_token=6.1,
        split_gpu_dense_ms_per_layer=0.38, split_kernel_call_ms=[0.2, 0.3, 0.9], graphs_per_token=6,
        eager_stages_per_token=5, gpu_ms_spread=[6.3, 6.1, 6.4, 9.0], wall_ms_spread=[13.3, 6.2, 6.5, 884.4],
    )  # fmt: skip
    results = {
        "vram": decode_result(1.6, [1, 2]),
        "ram unstaged": decode_result(4.0, [1, 2], pcie_bytes_per_token=100e6),
        "ram, CPU share": decode_result(6.4, [1, 2], pcie_bytes_per_token=60e6, **split),
    }
    table = decode_table(results, disk_gbps=2.0, pcie_gbps=50.0, layers=4)
    assert (
        "(4 split layers, posted to the split server): CPU kernel 1.00 ms (40.0 GB/s in place) on 14 threads "
        "(a call: median 0.200 ms, p90 0.300, max 0.900); the GPU's time a token 6.10 ms (median, CUDA "
        "events around it); a token's GPU time: mean 6.30 ms, median 6.10, p90 6.40, max 9.00; a token's "
        "wall time: mean 13.30 ms, median 6.20, p90 6.50, max 884.40; a token replays 6 graphs around 5 "
        "eager stages; "
        "GPU" in table
    )
    assert (
        "its share 1.50 ms, then idle until the CPU's answer 0.30 ms, from the CPU's answer to the next "
        "layer's send 0.380 ms a layer" in table
    )
    assert "the bus alone d + 10 blocks = 0.900 ms; split d + max(CPU 4, bus 6 blocks) = 0.700 ms" in table
    assert "measured: split 1.600, `ram unstaged` 1.00" in table
    # 5 on the CPU: 0.3125 ms against the bus's 0.25; 4 is the best
    assert "best share at these rates: 4 of 10 experts, 0.700 ms a layer, 1.29x the bus alone." in table
    # the GPU's 6 blocks took 1.5 / 4 ms: 40 GB/s in place; 5 on each side 0.3125 ms
    assert "its measured rate (40.0 GB/s, CUDA events): best 5 of 10, 0.713 ms a layer, 1.26x" in table
    # without the `vram` regime there is no d: the timed gap between split layers holds host launches
    del results["vram"]
    table = decode_table(results, disk_gbps=2.0, pcie_gbps=50.0, layers=4)
    assert "Model: needs the `vram` regime" in table and "Model a layer" not in table


def test_regimes_compare_the_tokens_both_decoded():
    # the CPU share's warm-up runs until its share is tuned, so it decodes more tokens than the others
    from expertstream.bench.runtime import same_tokens, tokens_note

    first = {"tokens": [1, 2, 3], "margins": [0.5, 0.125, 0.25]}
    assert same_tokens({"tokens": [1, 2, 3, 4, 5]}, first, "vram") == "yes"
    assert same_tokens({"tokens": [1, 9, 3, 4]}, first, "vram") == "NO from token 2 (vram top-2 margin 0.125)"
    assert "): yes." in tokens_note({"vram": first, "split": {"tokens": [1, 2, 3, 7]}})
    assert "NO (`split` differ)" in tokens_note({"vram": first, "split": {"tokens": [1, 2, 4, 7]}})
