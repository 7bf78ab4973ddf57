"""`expertstream setup` / `verify` and the workdir manifest on the tiny synthetic snapshot; bad inputs."""

import json
import logging
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from expertstream.cli import main as cli_main
from expertstream.formats.expert_block import PROJ
from expertstream.formats.fp8 import dequantize_fp8_rows
from expertstream.formats.snapshot import Snapshot, SnapshotError, read_header
from expertstream.workdir.inventory import PREFIX, SetupError, resident_spec
from expertstream.workdir.repack import plan_setup, setup_workdir
from expertstream.workdir.verify import verify_workdir
from expertstream.workdir.workdir import Workdir, WorkdirError

E_NAME = PREFIX + "layers.{l}.mlp.experts.{e}.{sub}"


def _expected_block(snap: Snapshot, layout, l: int, e: int) -> bytes:
    return layout.pack({p.name: snap.read(E_NAME.format(l=l, e=e, sub=p.name)) for p in layout.parts})


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensor(snap_dir: Path, name: str, fn) -> None:
    """Rewrite the shard holding `name` with fn(tensor) in its place (None: drop it, and from the index)."""
    index_path = snap_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = snap_dir / index["weight_map"][name]
    tensors = load_file(shard)
    new = fn(tensors[name])
    if new is None:
        del tensors[name], index["weight_map"][name]
        index_path.write_text(json.dumps(index))
    else:
        tensors[name] = new
    save_file(tensors, shard)


def _assert_refused(snap_dir: Path, target: Path, *fragments: str, exc=SetupError) -> None:
    with pytest.raises(exc) as info:
        setup_workdir(snap_dir, target, progress=False)
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))
    assert not target.exists()  # nothing that could pass for a workdir


def test_workdir_contents_match_snapshot(tiny_snapshot, tiny_workdir):
    wd, snap = Workdir(tiny_workdir), Snapshot(tiny_snapshot)
    tc = snap.text_config
    L, E, H = tc["num_hidden_layers"], tc["num_experts"], tc["hidden_size"]
    m = wd.manifest
    assert (m["format"], m["version"], m["model_type"]) == ("expertstream-workdir", 1, "qwen4_exp")
    assert m["source"] == {"snapshot": str(tiny_snapshot.resolve()), "config_sha256": snap.config_sha256}
    assert (wd.num_layers, wd.num_experts) == (L, E)
    assert wd.layout.hidden_size == H and wd.layout.intermediate_size == tc["moe_intermediate_size"]

    # every block: the snapshot's six tensors at the layout's offsets, zero padding, crc32 in the manifest
    data = wd.experts_path.read_bytes()
    assert len(data) == L * E * wd.layout.block_bytes
    for l in range(L):
        for e in range(E):
            off = wd.block_offset(l, e)
            block = data[off : off + wd.layout.block_bytes]
            assert block == _expected_block(snap, wd.layout, l, e), (l, e)
            assert zlib.crc32(block) == m["experts"]["checksums"][l * E + e]
    ws2, inp = wd.expert_scales()
    for l, e, j in [(0, 0, 0), (L - 1, E - 1, 2), (1, 5, 1)]:
        assert ws2[l, e, j] == snap.read(E_NAME.format(l=l, e=e, sub=f"{PROJ[j]}.weight_scale_2"))
        assert inp[l, e, j] == snap.read(E_NAME.format(l=l, e=e, sub=f"{PROJ[j]}.input_scale"))
    assert torch.equal(ws2[..., 0], ws2[..., 1])

    # resident: every text weight but experts and the PLE table, prefix removed, values unchanged
    res = wd.load_resident()
    spec = resident_spec(tc)
    assert set(spec) <= set(res) and set(res) - set(spec) <= {
        "hyper_connection_mixer.block_inject_weight.weight"
    }
    assert all(
        (str(res[n].dtype), tuple(res[n].shape)) == ("torch.bfloat16", spec[n][1])
        for n in spec
        if spec[n][0] == "BF16"
    )
    assert not [
        n for n in res if ".experts." in n or "ngram_embedding" in n or n.startswith(("mtp.", "model."))
    ]
    for name in ("lm_head.weight", "embed_tokens.weight", "layers.0.linear_attn.in_proj_qkv.weight"):
        assert torch.equal(res[name], snap.read(name if name == "lm_head.weight" else PREFIX + name))
    assert m["resident"] == {
        "file": "resident.safetensors",
        "fp8_row_scaled": [],
        "bytes": m["budget"]["resident_bytes"],
    }

    # PLE read in place: shard offsets hit the snapshot's rows; the BF16 0-d scale read as BF16
    ple, layer = wd.ple, tc["ple_layer_ids"][0] - 1
    base = f"{PREFIX}layers.{layer}.ple.ple_embedding.ngram_embedding"
    scale = snap.read(f"{base}.weight_scale")
    assert scale.dtype == torch.bfloat16 and ple["scale"] == scale.item()
    assert ple["layer"] == layer and ple["width"] == tc["ple_embed_dim"] // 16
    for i, s in enumerate(ple["shards"]):
        table = snap.read(f"{base}.shard_{i}.weight").view(torch.uint8)
        with open(s["path"], "rb") as f:
            f.seek(s["offset"] + (s["rows"] - 1) * ple["width"])
            assert f.read(ple["width"]) == table[-1].numpy().tobytes()
    assert ple["rows"] == sum(s["rows"] for s in ple["shards"])

    block = wd.layout.block_bytes
    assert m["budget"]["expert_bytes_per_token"] == tc["num_experts_per_tok"] * L * block
    assert m["budget"]["ple_bytes_per_token"] == 16 * ple["width"]
    for f in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (tiny_workdir / f).read_bytes() == (tiny_snapshot / f).read_bytes()


def test_fp8_dense_copy_ple_and_rerun(tiny_snapshot, tmp_path):
    out = setup_workdir(tiny_snapshot, tmp_path / "wd", fp8_dense=True, copy_ple=True, progress=False)
    wd, snap = Workdir(out), Snapshot(tiny_snapshot)
    fp8 = wd.manifest["resident"]["fp8_row_scaled"]
    gdn = [
        n
        for n in resident_spec(snap.text_config)
        if ".linear_attn.in_proj_qkv." in n or ".linear_attn.out_proj." in n
    ]
    assert gdn and set(gdn) <= set(fp8) and wd.fp8_row_scaled == set(fp8)
    name = gdn[0]
    t = wd.load_resident([name])
    assert set(t) == {name, f"{name}_scale"} and t[name].dtype == torch.float8_e4m3fn
    ref = snap.read(PREFIX + name).float()
    deq = dequantize_fp8_rows(t[name], t[f"{name}_scale"])
    assert (deq - ref).abs().max() <= ref.abs().amax() / 16  # E4M3: 3 mantissa bits

    # copied PLE: one relative file in the manifest, absolute through Workdir.ple, same rows as the snapshot
    raw = wd.manifest["ple"]["shards"]
    assert raw == [{"path": "ple/ngram_embedding.bin", "offset": 0, "rows": wd.ple["rows"]}]
    assert wd.ple["shards"][0]["path"] == str(out / "ple" / "ngram_embedding.bin")
    assert verify_workdir(out, check_all=True) == []

    # a rerun into the same directory replaces everything, including the stale PLE copy
    setup_workdir(tiny_snapshot, out, progress=False)
    wd2 = Workdir(out)
    assert wd2.manifest["resident"]["fp8_row_scaled"] == [] and not (out / "ple").exists()
    assert wd2.manifest["budget"]["resident_bytes"] > wd.manifest["budget"]["resident_bytes"]
    assert verify_workdir(out, check_all=True) == []


def test_cli_setup_and_verify(tiny_snapshot, tiny_workdir, tmp_path, capsys, caplog):
    assert cli_main(["verify", str(tiny_workdir), "--all"]) == 0
    with caplog.at_level(logging.INFO, logger="expertstream.workdir.repack"):
        assert cli_main(["setup", str(tiny_snapshot), str(tmp_path / "wd"), "--no-progress"]) == 0
    assert "verify" in capsys.readouterr().out
    budget = Workdir(tmp_path / "wd").manifest["budget"]
    assert f"expert bytes per token: {budget['expert_bytes_per_token']:,} B" in caplog.text
    assert f"PLE bytes per token: {budget['ple_bytes_per_token']:,} B" in caplog.text
    assert cli_main(["setup", str(tiny_snapshot / "nope"), str(tmp_path / "wd2")]) == 1
    assert "config.json not found" in capsys.readouterr().out


def test_verify_names_corrupted_blocks(tiny_workdir, tmp_path, capsys):
    wd_dir = _copy(tiny_workdir, tmp_path / "wd")
    wd = Workdir(wd_dir)
    E, bb = wd.num_experts, wd.layout.block_bytes
    with open(wd.experts_path, "r+b") as f:
        for l, e, at in [(2, 7, 100), (1, 3, bb - 1)]:  # a weight byte, and a padding byte
            f.seek(wd.block_offset(l, e) + at)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ 0x10]))
    problems = verify_workdir(wd_dir, check_all=True)
    assert len(problems) == 2
    assert "(layer 1, expert 3)" in problems[0] and "(layer 2, expert 7)" in problems[1]
    assert cli_main(["verify", str(wd_dir), "--all"]) == 1
    assert "(layer 2, expert 7)" in capsys.readouterr().out
    # without --all a flipped byte in a corner block is still found by the byte comparison
    with open(wd.experts_path, "r+b") as f:
        f.seek(wd.block_offset(0, E - 1) + 3)
        f.write(b"\xff\x00")
    problems = verify_workdir(wd_dir, samples=0)
    assert any("(layer 0, expert 15)" in p and "gate_proj.weight differs" in p for p in problems), problems


def test_verify_checks_resident_tensors(tiny_workdir, tmp_path):
    wd_dir = _copy(tiny_workdir, tmp_path / "wd")
    tensors = load_file(wd_dir / "resident.safetensors")
    del tensors["layers.2.mlp.shared_expert.down_proj.weight"]
    tensors["layers.0.linear_attn.A_log"] = tensors["layers.0.linear_attn.A_log"][:-1].contiguous()
    save_file(tensors, wd_dir / "resident.safetensors")
    problems = verify_workdir(wd_dir)
    assert any("layers.2.mlp.shared_expert.down_proj.weight is missing" in p for p in problems)
    assert any("layers.0.linear_attn.A_log" in p for p in problems)


def test_workdir_refuses_unfinished(tiny_workdir, tmp_path):
    wd_dir = _copy(tiny_workdir, tmp_path / "wd")
    manifest = json.loads((wd_dir / "manifest.json").read_text())
    for edit, fragment in [
        (lambda m: m.update(version=2), "version 2"),
        (lambda m: m["experts"].pop("checksums"), "checksums"),
        (lambda m: m.update(format="other"), "not an expertstream workdir"),
    ]:
        m = json.loads(json.dumps(manifest))
        edit(m)
        (wd_dir / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(WorkdirError, match=fragment):
            Workdir(wd_dir)
    (wd_dir / "manifest.json").write_text(json.dumps(manifest)[:-40])  # a torn write
    with pytest.raises(WorkdirError, match="not valid JSON"):
        Workdir(wd_dir)
    (wd_dir / "manifest.json").write_text(json.dumps(manifest))
    Workdir(wd_dir)
    with open(wd_dir / "experts.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(WorkdirError, match="experts.bin has 100 bytes"):
        Workdir(wd_dir)
    (wd_dir / "manifest.json").unlink()
    with pytest.raises(WorkdirError, match="no manifest.json"):
        Workdir(wd_dir)


def test_refuses_missing_tensor(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path / "snap")
    name = E_NAME.format(l=2, e=5, sub="down_proj.weight_scale")
    _edit_tensor(snap, name, lambda t: None)
    _assert_refused(snap, tmp_path / "wd", name, "missing")


def test_refuses_wrong_dtype_and_shape(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path / "snap")
    name = PREFIX + "layers.0.linear_attn.in_proj_z.weight"
    _edit_tensor(snap, name, lambda t: t.float())
    _assert_refused(snap, tmp_path / "wd", name, "F32", "expected BF16")
    snap2 = _copy(tiny_snapshot, tmp_path / "snap2")
    name = E_NAME.format(l=0, e=0, sub="gate_proj.weight")
    _edit_tensor(snap2, name, lambda t: t[:-1].contiguous())
    _assert_refused(snap2, tmp_path / "wd", name, "expected U8")


def test_refuses_truncated_shard(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path / "snap")
    shard = sorted(snap.glob("model-0*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    _assert_refused(snap, tmp_path / "wd", shard.name, "truncated", exc=SnapshotError)


def test_refuses_unknown_model_and_quant(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path / "snap")
    cfg_path = snap / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "model_type": "llama"}))
    _assert_refused(snap, tmp_path / "wd", "model_type 'llama'")
    q = json.loads(json.dumps(cfg))
    q["quantization_config"]["quantized_layers"][PREFIX + "layers.1.mlp.experts"]["quant_algo"] = "FP8"
    cfg_path.write_text(json.dumps(q))
    _assert_refused(snap, tmp_path / "wd", PREFIX + "layers.1.mlp.experts", "FP8")
    del q["quantization_config"]
    cfg_path.write_text(json.dumps(q))
    (snap / "hf_quant_config.json").unlink()
    _assert_refused(snap, tmp_path / "wd", "no quantization_config")


def test_accepts_older_plain_nvfp4_quant_config(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path / "snap")
    cfg = json.loads((snap / "config.json").read_text())
    old_ignore = ["model.embed_tokens", "mtp.*", "*.self_attn.*", "*.linear_attn.*", "*.mlp.gate*", "*.ple.*"]
    cfg["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "ignore": old_ignore,
    }
    (snap / "config.json").write_text(json.dumps(cfg))
    assert plan_setup(snap, fp8_dense=False).num_layers == cfg["text_config"]["num_hidden_layers"]
    cfg["quantization_config"]["ignore"].append("*.mlp.experts*")
    (snap / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SetupError, match="quantized as None"):
        plan_setup(snap, fp8_dense=False)


def test_refuses_gate_up_scale_mismatch(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path / "snap")
    _edit_tensor(snap, E_NAME.format(l=3, e=9, sub="up_proj.weight_scale_2"), lambda t: t * 2)
    with pytest.raises(SetupError, match=r"layers\.3\.mlp\.experts\.9 has gate weight_scale_2"):
        setup_workdir(snap, tmp_path / "wd", progress=False)
    assert not (tmp_path / "wd").exists()


def test_refuses_full_disk(tiny_snapshot, tmp_path, monkeypatch):
    import expertstream.workdir.repack as repack

    real = shutil.disk_usage
    monkeypatch.setattr(repack.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    _assert_refused(tiny_snapshot, tmp_path / "wd", "not enough free disk", str(tmp_path / "wd"))


def test_rerun_after_failure_is_not_finished(tiny_snapshot, tiny_workdir, tmp_path, monkeypatch):
    """A setup that dies mid-way into an existing workdir leaves it without a manifest."""
    import expertstream.workdir.repack as repack

    wd_dir = _copy(tiny_workdir, tmp_path / "wd")

    def boom(*a, **k):
        raise OSError("disk on fire")

    monkeypatch.setattr(repack, "_write_resident", boom)
    with pytest.raises(OSError, match="disk on fire"):
        setup_workdir(tiny_snapshot, wd_dir, progress=False)
    with pytest.raises(WorkdirError, match="no manifest.json"):
        Workdir(wd_dir)


def test_header_parser_agrees_with_safetensors(tiny_snapshot):
    from safetensors import safe_open

    shard = sorted(tiny_snapshot.glob("model-0*.safetensors"))[0]
    infos, snap = read_header(shard), Snapshot(tiny_snapshot)
    with safe_open(shard, "pt") as f:
        assert set(f.keys()) == set(infos)
        for name in infos:
            t = f.get_tensor(name)
            assert infos[name].shape == tuple(t.shape)
            got = snap.read(name)
            assert got.dtype == t.dtype and torch.equal(
                got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
            )


def test_interrupted_setup_resumes_without_rereading_written_blocks(tiny_snapshot, tmp_path, monkeypatch):
    import expertstream.workdir.repack as repack

    monkeypatch.setattr(repack, "PROGRESS_EVERY", 4)
    real_check, seen = repack._check_scales, []

    def interrupt_after_20_blocks(ws2, plan, l, e):
        seen.append((l, e))
        if len(seen) > 20:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the experts
        real_check(ws2, plan, l, e)

    monkeypatch.setattr(repack, "_check_scales", interrupt_after_20_blocks)
    wd = tmp_path / "wd"
    with pytest.raises(KeyboardInterrupt):
        setup_workdir(tiny_snapshot, wd, progress=False)
    journal = json.loads((wd / repack.PROGRESS).read_text())
    done = len(journal["done"])
    assert 0 < done <= 20 and not (wd / "manifest.json").exists()  # unfinished: no Workdir accepts it
    with pytest.raises(WorkdirError):
        Workdir(wd)
    monkeypatch.setattr(repack, "_check_scales", real_check)

    read, real_iter = [], repack.iter_tensor_bytes

    def counting(infos):
        for info, data in real_iter(infos):
            read.append(info.name)
            yield info, data

    monkeypatch.setattr(repack, "iter_tensor_bytes", counting)
    setup_workdir(tiny_snapshot, wd, progress=False)
    plan = plan_setup(tiny_snapshot, False)
    codes = [n for n in read if n in plan.experts and plan.experts[n][2].endswith(".weight")]
    assert len(codes) == (plan.num_layers * plan.num_experts - done) * len(PROJ)  # only the missing blocks
    assert not (wd / repack.PROGRESS).exists()
    assert verify_workdir(wd, tiny_snapshot, check_all=True) == []  # resumed blocks and checksums intact

    # --restart (and a journal of another snapshot's files) reads every block again
    read.clear()
    (wd / repack.PROGRESS).write_text(json.dumps(journal))
    setup_workdir(tiny_snapshot, wd, progress=False, restart=True)
    codes = [n for n in read if n in plan.experts and plan.experts[n][2].endswith(".weight")]
    assert len(codes) == plan.num_layers * plan.num_experts * len(PROJ)
    # a journal resumes only the same files: a re-downloaded (touched) shard starts over
    (wd / repack.PROGRESS).write_text(json.dumps(journal))
    assert repack._resumable(plan, wd)
    shard = next(iter(sorted(tiny_snapshot.glob("model-0*.safetensors"))))
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        assert repack._resumable(plan_setup(tiny_snapshot, False), wd) == {}
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_refused_snapshot_leaves_nothing_to_resume(tiny_snapshot, tmp_path):
    import expertstream.workdir.repack as repack

    snap = _copy(tiny_snapshot, tmp_path / "snap")
    _edit_tensor(snap, E_NAME.format(l=3, e=9, sub="up_proj.weight_scale_2"), lambda t: t * 2)
    wd = tmp_path / "wd"
    wd.mkdir()  # made by the user: kept, but without a journal
    with pytest.raises(SetupError):
        setup_workdir(snap, wd, progress=False)
    assert not (wd / repack.PROGRESS).exists()
