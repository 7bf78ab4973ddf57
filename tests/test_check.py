"""`expertstream check`: passes on the tiny model in FP32, fails for both controls and a corrupted workdir."""

import json
import shutil
import zlib

import pytest
import torch

from expertstream.cli import main as cli
from expertstream.commands.check import build_reference, text_config_of
from expertstream.experts.cpu_bank import swap_nibbles
from expertstream.workdir.workdir import Workdir, write_manifest


def run_check(capsys, workdir, snapshot, *flags):
    rc = cli(["check", str(workdir), "--snapshot", str(snapshot), "--json", *flags])
    return rc, json.loads(capsys.readouterr().out)


def test_reference_builder_matches_transformers_own_loader(tiny_snapshot, tmp_path):
    """Our names, stacking (gate first), PLE concatenation and scales equal what from_pretrained makes of the
    BF16 twin, which synth writes as the NVFP4 model's dequantized weights rounded once to BF16."""
    from transformers import Qwen4ExpForConditionalGeneration

    from expertstream.synth.synth import write_synthetic

    twin = write_synthetic(tmp_path / "twin", preset="tiny", seed=0, dtype="bf16")
    hf = Qwen4ExpForConditionalGeneration.from_pretrained(
        twin, dtype=torch.float32, ignore_mismatched_sizes=True
    )
    want = {k.replace("model.language_model.", "model."): v for k, v in hf.state_dict().items()}
    got = build_reference(tiny_snapshot).state_dict()
    assert got.keys() <= want.keys()
    for name, t in got.items():
        t = t.to(torch.bfloat16).float() if t.is_floating_point() else t
        assert torch.equal(t, want[name]), name


@pytest.mark.parametrize(
    "spans", [(), ("--prefill-piece", "8", "--prefill-span", "32")], ids=["one-span", "layer-major"]
)
def test_check_passes_on_the_tiny_model(capsys, tiny_workdir, tiny_snapshot, spans):
    # layer-major: prompts in 32-token spans of 8-token pieces (each layer's experts once per span)
    rc, report = run_check(capsys, tiny_workdir, tiny_snapshot, "--prompts", "1", "--long", *spans)
    assert rc == 0 and report["pass"]
    assert report["argmax_agreement"] == 1.0 and report["positions"] >= 64
    assert report["mean_abs_dlogit"] <= 1e-3
    assert all(p["greedy_match"] == p["greedy_len"] == 16 for p in report["prompts"])
    text = text_config_of(tiny_snapshot)
    long = next(p for p in report["prompts"] if p["name"] == "long")
    assert long["tokens"] > text["indexer_budget"] + text["indexer_compress_ratio"]


@pytest.mark.parametrize("control", ["swap-nibbles", "no-experts"])
def test_controls_fail(capsys, tiny_workdir, tiny_snapshot, control):
    rc, report = run_check(
        capsys, tiny_workdir, tiny_snapshot, "--prompts", "1", "--continuation", "4", "--control", control
    )
    assert rc == 1 and not report["pass"]
    assert report["mean_abs_dlogit"] > 1e-2


def test_physically_corrupted_workdir_fails(capsys, tiny_workdir, tiny_snapshot, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_workdir, bad)
    wd = Workdir(bad)
    blob = torch.frombuffer(bytearray(wd.experts_path.read_bytes()), dtype=torch.uint8)
    bb = wd.layout.block_bytes
    weights = [p for p in wd.layout.parts if p.dtype == "uint8"]  # packed E2M1 codes, not the E4M3 scales
    assert len(weights) == 3
    for b in range(wd.num_layers * wd.num_experts):
        for p in weights:
            lo = b * bb + p.offset
            blob[lo : lo + p.nbytes] = swap_nibbles(blob[lo : lo + p.nbytes])
    wd.experts_path.write_bytes(blob.numpy().tobytes())
    # keep the workdir self-consistent so the engine loads it and only the numbers can tell
    manifest = wd.manifest
    manifest["experts"]["checksums"] = [
        zlib.crc32(blob[b * bb : (b + 1) * bb].numpy().tobytes())
        for b in range(wd.num_layers * wd.num_experts)
    ]
    write_manifest(bad, manifest)
    rc, report = run_check(capsys, bad, tiny_snapshot, "--prompts", "1", "--continuation", "4")
    assert rc == 1 and not report["pass"]


def test_bfloat16_bounds_pass_the_engine_and_fail_a_control(capsys, tiny_workdir, tiny_snapshot):
    flags = ("--prompts", "1", "--long", "--dtype", "bfloat16", "--continuation", "8")
    rc, report = run_check(capsys, tiny_workdir, tiny_snapshot, *flags)
    assert rc == 0 and report["argmax_agreement"] > 0.9
    rc, report = run_check(capsys, tiny_workdir, tiny_snapshot, *flags, "--control", "swap-nibbles")
    assert rc == 1 and report["mean_abs_dlogit"] > report["thresholds"]["mean_abs"]
