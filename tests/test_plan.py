"""`expertstream plan`: the VRAM plan and a token's expert bytes, before anything loads (CPU only)."""

import pytest
import torch

from expertstream.cli import main as cli_main
from expertstream.commands.plan import prompt_bytes, token_bytes
from expertstream.memory_plan import GiB


def test_token_bytes_splits_the_routed_blocks_over_the_tiers():
    # 4 layers x 8 experts of 100 B, top-2: 800 B routed; VRAM holds a quarter of the blocks, RAM half
    tb = token_bytes(4, 8, 2, 100, vram_blocks=8, ram_gb=16 * 100 / GiB)
    assert (tb.routed, tb.vram_share, tb.ram_share) == (800, 0.25, 0.5)
    assert (tb.from_disk, tb.over_bus, tb.ram_holds_all) == (200, 600, False)
    # a RAM cache with a row for every block: nothing from the drive, everything over the bus
    tb = token_bytes(4, 8, 2, 100, vram_blocks=0, ram_gb=40 * 100 / GiB)
    assert (tb.ram_share, tb.from_disk, tb.over_bus, tb.ram_holds_all) == (1.0, 0, 800, True)
    # every block in VRAM: no expert byte moves; the RAM share counts only blocks VRAM does not hold
    tb = token_bytes(4, 8, 2, 100, vram_blocks=32, ram_gb=16 * 100 / GiB)
    assert (tb.ram_share, tb.from_disk, tb.over_bus) == (0.0, 0, 0)
    # every block in RAM and a partial VRAM cache: the engine reads them from RAM but for its hot set, here
    # 4 of the 8 cache blocks (the prompt passes keep the rest), and none without one
    tb = token_bytes(4, 8, 2, 100, vram_blocks=8, ram_gb=40 * 100 / GiB, hot_blocks=4)
    assert (tb.vram_share, tb.ram_share, tb.from_disk, tb.over_bus) == (0.125, 0.875, 0, 700)
    tb = token_bytes(4, 8, 2, 100, vram_blocks=8, ram_gb=40 * 100 / GiB)
    assert (tb.vram_share, tb.ram_share, tb.from_disk, tb.over_bus) == (0.0, 1.0, 0, 800)


def test_prompt_bytes_fetch_each_routed_expert_once_per_span():
    tb = token_bytes(4, 8, 2, 100, vram_blocks=8, ram_gb=16 * 100 / GiB)  # VRAM 1/4, RAM 1/2 of 32 blocks
    # one token routes to a quarter of a layer's experts in expectation: a decode token's bytes
    assert prompt_bytes(1, 400, 4, 8, 2, 100, tb) == (1, tb.from_disk, tb.over_bus)
    # 1,000 tokens in 400-token spans: 3 spans, each fetching (nearly) every block once
    spans, far, bus = prompt_bytes(1000, 400, 4, 8, 2, 100, tb)
    assert spans == 3 and far == round(3 * 3200 * 0.25) and bus == round(3 * 3200 * 0.75)


def test_plan_prints_the_vram_plan_and_the_bound(tiny_workdir, capsys):
    argv = ["plan", str(tiny_workdir), "--gpu-memory-gb", "4", "--ram-cache-gb", "0", "--pcie-gbps", "25"]
    assert cli_main(argv + ["--disk-gbps", "2"]) == 0
    out = capsys.readouterr().out
    assert "VRAM plan for a 3.60 GiB budget:" in out and "VRAM expert cache" in out
    # the tiny model's experts all fit in 3.6 GiB: nothing moves per token
    assert "in the VRAM cache (100.0% of the blocks)" in out and "no expert bytes move" in out
    # the drive's rate measured when not given (O_DIRECT reads of the working directory's blocks)
    assert cli_main(argv[:2] + ["--gpu-memory-gb", "4"]) == 0
    rate = capsys.readouterr().out.split("from the drive, at ")[1].split(" GB/s")[0]
    assert float(rate) > 0


def test_the_bound_is_the_slower_of_drive_and_bus(tiny_workdir):
    from expertstream.commands.plan import TokenBytes, report
    from expertstream.workdir.workdir import Workdir

    plan = Workdir(tiny_workdir).memory_plan(4 * GiB, 512)
    tb = TokenBytes(routed=int(2e9), vram_share=0.25, ram_share=0.25, from_disk=int(1e9), over_bus=int(1.5e9),
                    ram_holds_all=False)  # fmt: skip
    # 1 GB at 2 GB/s = 500 ms from the drive; 1.5 GB at 10 GB/s = 150 ms over the bus: 2 tok/s; a prompt
    # of 3 spans moving 6 GB from the drive and 9 GB over the bus takes at least 3 s
    out = report(plan, tb, disk=2.0, pcie=10.0, ram_gb=0, prompts={4096: (3, int(6e9), int(9e9))})
    assert "= 500.0 ms" in out and "= 150.0 ms" in out and "at most 2.0 tok/s" in out
    assert "4,096 tokens, 3 spans" in out and "at least 3.0 s" in out
    # a slow bus bounds it instead: 1.5 GB at 1 GB/s
    assert "at most 0.7 tok/s" in report(plan, tb, disk=2.0, pcie=1.0, ram_gb=0)
    # without a GPU or --pcie-gbps the bus rate is unknown: the drive's share alone is a bound, said so
    out = report(plan, tb, disk=2.0, pcie=None, ram_gb=0)
    assert "over PCIe, rate unknown (--pcie-gbps)" in out and "unknown: the bus rate" in out
    assert "at most 2.0 tok/s from the known rates" in out
    # nothing known, and bytes to move: no bound at all, and never "no expert bytes move"
    out = report(plan, tb, disk=None, pcie=None, ram_gb=0, prompts={4096: (3, int(6e9), int(9e9))})
    assert "tok/s" not in out and "no expert bytes move" not in out and "time unknown" in out


def test_the_ram_cache_size_is_weighed_against_the_machines_ram(tiny_workdir, monkeypatch):
    from expertstream.commands import plan as plan_cli
    from expertstream.workdir.workdir import Workdir

    plan = Workdir(tiny_workdir).memory_plan(4 * GiB, 512)
    tb = plan_cli.TokenBytes(int(2e9), 0.0, 0.25, int(1.5e9), int(2e9), False)
    monkeypatch.setattr(plan_cli, "physical_ram", lambda: 64 * GiB)
    # 60 of 64 GiB pinned: a warning; 4 of 64 with experts still read from the drive: a hint up to 48
    assert "pins 94% of this machine's 64 GiB" in plan_cli.report(plan, tb, 2.0, None, ram_gb=60)
    assert "up to about 48 keeps more experts off the drive" in plan_cli.report(plan, tb, 2.0, None, ram_gb=4)
    # nothing to say about 30 GiB, nor when nothing comes from the drive
    assert "note: this machine" not in plan_cli.report(plan, tb, 2.0, None, ram_gb=30)
    resident = plan_cli.TokenBytes(int(2e9), 0.0, 1.0, 0, int(2e9), True)
    assert "off the drive" not in plan_cli.report(plan, resident, 2.0, None, ram_gb=4)
    # every expert in RAM: whether decode reads a hot set from VRAM
    assert "reads every block from RAM (too few VRAM cache slots" in plan_cli.report(
        plan, resident, 2.0, None, ram_gb=30
    )
    hot = plan_cli.TokenBytes(int(2e9), 0.125, 0.875, 0, int(1.75e9), True)
    assert "reads its hot set (12.5% of the blocks) from VRAM" in plan_cli.report(
        plan, hot, 2.0, None, ram_gb=30
    )


def test_plan_refuses_a_budget_below_the_minimum(tiny_workdir, capsys):
    assert cli_main(["plan", str(tiny_workdir), "--gpu-memory-gb", "0.001", "--disk-gbps", "1"]) == 1
    assert "cannot hold this model" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans for the visible GPU when there is one")
def test_plan_without_a_gpu_asks_for_a_budget(tiny_workdir, capsys):
    assert cli_main(["plan", str(tiny_workdir), "--disk-gbps", "1"]) == 1
    assert "give --gpu-memory-gb" in capsys.readouterr().err


def test_plan_from_a_snapshot_or_its_config_before_setup_is_the_workdirs_plan(
    tiny_snapshot, tiny_workdir, capsys
):
    flags = ["--gpu-memory-gb", "4", "--ram-cache-gb", "0", "--disk-gbps", "2", "--pcie-gbps", "25"]
    assert cli_main(["plan", str(tiny_workdir), *flags]) == 0
    from_workdir = capsys.readouterr().out
    for source in (tiny_snapshot, tiny_snapshot / "config.json"):
        assert cli_main(["plan", str(source), *flags]) == 0
        out = capsys.readouterr().out
        # the same plan and bounds, after what setup will write
        assert out.startswith("setup writes about") and out.endswith(from_workdir)
    # before setup the drive's rate cannot be measured: unknown, not guessed
    assert cli_main(["plan", str(tiny_snapshot / "config.json"), "--gpu-memory-gb", "4"]) == 0
    assert "from the drive, rate unknown (--disk-gbps)" in capsys.readouterr().out


def test_plan_of_a_model_id_offline_says_how_to_pass_its_config(monkeypatch, capsys):
    import socket

    def offline(*a, **k):
        raise OSError(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", offline)
    assert cli_main(["plan", "nvidia/Qwen3.8-Flash-Next-NVFP4", "--gpu-memory-gb", "8"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach huggingface.co (Name or service not known)" in err
    assert "huggingface-cli download nvidia/Qwen3.8-Flash-Next-NVFP4 config.json --local-dir DIR" in err
    assert len(err.strip().splitlines()) == 1


def test_the_cpu_share_takes_what_balances_the_bus():
    from expertstream.commands.plan import cpu_share_lines

    # every block in RAM: 10 experts of 100 MB a token over a 50 GB/s bus = 20 ms alone
    ram_gb = 64 * 1e8 / GiB + 1
    tb = token_bytes(1, 64, 10, int(1e8), vram_blocks=0, ram_gb=ram_gb)
    lines = cpu_share_lines(tb, 1, 10, pcie=50.0, cpu=25.0, how="given")
    # 25 / 75 of 10 -> 3 on the CPU (300 MB at 25 GB/s = 12 ms), 7 over the bus (14 ms): 71.4 tok/s
    assert "the CPU expert kernel at 25.0 GB/s (given)" in lines[0]
    want = "  3 of 10 experts a layer on the CPU, 7 on the GPU: at most 71.4 tok/s from these bytes, 1.43x"
    assert lines[2] == want + " the bus alone"
    assert "none" in cpu_share_lines(tb, 1, 10, pcie=50.0, cpu=1.0, how="given")[2]
    # a hot set of 16 of the 64 blocks in VRAM serves 2.5 of the 10: the bus alone carries 7.5 (15 ms); the
    # CPU takes blocks that would cross it, so 2 on the CPU (8 ms) leave 5.5 to the bus (11 ms): 90.9 tok/s
    # (3, as the rates alone choose, would take 12 ms on the CPU)
    tb = token_bytes(1, 64, 10, int(1e8), vram_blocks=16, ram_gb=ram_gb, hot_blocks=16)
    want = "  2 of 10 experts a layer on the CPU, 8 on the GPU: at most 90.9 tok/s from these bytes, 1.36x"
    assert cpu_share_lines(tb, 1, 10, pcie=50.0, cpu=25.0, how="given")[2] == want + " the bus alone"


def test_the_cpu_share_weighs_the_gpu_side_at_its_own_rate():
    from expertstream.commands.plan import cpu_share_lines

    ram_gb = 64 * 1e8 / GiB + 1
    tb = token_bytes(1, 64, 10, int(1e8), vram_blocks=0, ram_gb=ram_gb)
    # the bus alone 50 GB/s (20 ms); while splitting the GPU's share crosses at 40 (2.5 ms a block), the CPU
    # takes 4 ms a block: 4 on the CPU (16 ms) beside 6 (15 ms), where the bus rate alone would give 3
    lines = cpu_share_lines(tb, 1, 10, pcie=50.0, cpu=25.0, how="given", stage=(40.0, "measured"))
    assert lines[1] == "  the GPU's share crossing at 40.0 GB/s beside it (measured)"
    want = "  4 of 10 experts a layer on the CPU, 6 on the GPU: at most 62.5 tok/s from these bytes, 1.25x"
    assert lines[2] == want + " the bus alone"
    alone = cpu_share_lines(tb, 1, 10, pcie=50.0, cpu=25.0, how="")
    assert alone[1] == "  the GPU's share crossing at 50.0 GB/s beside it (the bus rate)"


def test_plan_says_what_a_cpu_share_gives_another_box(tmp_path, capsys):
    import json

    from expertstream.synth.synth import build_config

    names = ("<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    config = build_config("full-shape", 4, None, 1024, {n: i for i, n in enumerate(names)})
    (tmp_path / "config.json").write_text(json.dumps(config))
    # 4 full-shape layers' 2,048 blocks (5.7 GB) all in the RAM cache
    argv = ["plan", str(tmp_path / "config.json"), "--gpu-memory-gb", "8", "--ram-cache-gb", "8"]
    assert cli_main(argv + ["--pcie-gbps", "50", "--cpu-gbps", "25"]) == 0
    out = capsys.readouterr().out
    assert "CPU share of decode (--cpu-moe-share -1), the CPU expert kernel at 25.0 GB/s (--cpu-gbps)" in out
    # the hot set the 8 GiB plan keeps in VRAM serves a share of the 10: 2 on the CPU, not the rates' 3
    assert "2 of 10 experts a layer on the CPU, 8 on the GPU" in out
    assert "crossing at 50.0 GB/s beside it (not measured: the bus rate, an upper bound)" in out
    assert cli_main(argv + ["--pcie-gbps", "50", "--cpu-gbps", "25", "--stage-gbps", "40"]) == 0
    assert "the GPU's share crossing at 40.0 GB/s beside it (--stage-gbps)" in capsys.readouterr().out
    # another box weighed from its cores and memory rate, with this box's kernel rates
    assert cli_main(argv + ["--pcie-gbps", "50", "--cpu-cores", "16", "--mem-gbps", "100"]) == 0
    assert "16 cores x " in capsys.readouterr().out
    # no bus rate (no GPU to measure it): nothing to weigh the CPU against
    if not torch.cuda.is_available():
        assert cli_main(argv + ["--cpu-gbps", "25"]) == 0 and "CPU share" not in capsys.readouterr().out
