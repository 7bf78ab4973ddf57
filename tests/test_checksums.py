"""Every byte of a working directory is checked: file checksums in the manifest, `verify --all`, expert blocks
checked as they arrive (a damaged block fails its request, the server keeps serving), and load failures
that are one sentence (docs/workdir.md)."""

import json
import re
import shutil

import httpx
import pytest
from safetensors.torch import load_file, save_file

from expertstream.cli import main as cli_main
from expertstream.config import EngineConfig
from expertstream.store import ExpertStore, StoreError
from expertstream.workdir.checksum import ALGORITHM, file_checksum
from expertstream.workdir.inventory import SetupError
from expertstream.workdir.repack import setup_workdir
from expertstream.workdir.verify import verify_workdir
from expertstream.workdir.workdir import MANIFEST, Workdir, WorkdirError, write_manifest

AGAIN = "run `expertstream setup` again"


@pytest.fixture
def wd(tiny_workdir, tmp_path):
    return shutil.copytree(tiny_workdir, tmp_path / "wd")


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_records_every_file(wd):
    files = json.loads((wd / MANIFEST).read_text())["files"]
    on_disk = {str(p.relative_to(wd)) for p in wd.rglob("*") if p.is_file()} - {MANIFEST, "experts.bin"}
    assert set(files) == on_disk
    assert {"resident.safetensors", "expert_scales.safetensors", "config.json", "tokenizer.json"} <= on_disk
    assert {"chat_template.jinja", "tokenizer_config.json", "generation_config.json"} <= on_disk
    for name, entry in files.items():
        assert (entry["bytes"], entry[ALGORITHM]) == file_checksum(wd / name), name


@pytest.mark.parametrize("name", ["resident.safetensors", "expert_scales.safetensors", "chat_template.jinja"])
def test_verify_all_names_a_changed_byte_in_any_file(wd, name, capsys):
    _flip(wd / name, (wd / name).stat().st_size - 3)  # a data byte, the header stays readable
    problems = verify_workdir(wd, check_all=True)
    # first the file (the snapshot comparison may name the changed value too)
    assert problems[0] == f"{wd / name} does not match the {ALGORITHM} setup recorded: it changed after setup"
    assert cli_main(["verify", str(wd), "--all"]) == 1
    assert name in capsys.readouterr().out


def test_a_block_changed_on_disk_fails_its_request_and_is_read_again(tiny_workdir, wd, host_alloc):
    w = Workdir(wd)
    where = slice(w.block_offset(2, 5), w.block_offset(2, 6))
    pristine = (tiny_workdir / "experts.bin").read_bytes()[where]
    with open(w.experts_path, "r+b") as f:
        f.seek(where.start)
        f.write(bytes(len(pristine)))  # a zeroed block
    with ExpertStore(w, ram_cache_bytes=64 * w.layout.block_bytes, io_threads=2, **host_alloc) as store:
        h = store.request([(2, 5)])[0]
        with pytest.raises(
            StoreError, match=r"expert block \(layer 2, expert 5\) read from .* does not match"
        ):
            h.wait()
        h.release()
        assert (
            store.stats.blocks_checked == 1
            and store.stats.checksum_seconds >= store.stats.checksum_cpu_seconds > 0
        )
        # the bad block was not cached: once the file is good again the next request reads it again
        with open(w.experts_path, "r+b") as f:
            f.seek(where.start)
            f.write(pristine)
        h = store.request([(2, 5)])[0]
        assert bytes(h.wait().numpy()) == pristine
        h.release()
        assert store.stats.misses == 2


def test_damaged_block_under_a_running_server(tiny_workdir, wd):
    from server_helpers import LiveServer, real_settings

    from expertstream.runtime.engine import Engine
    from expertstream.server.app import create_app

    engine = Engine(EngineConfig(model=str(wd), device="cpu", max_model_len=512, ram_cache_gb=0.0))
    server = LiveServer(create_app(real_settings(default_max_tokens=1), engine.tokenizer, lambda: engine))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}]}
    w = Workdir(wd)
    layer0 = slice(w.block_offset(0, 0), w.block_offset(1, 0))
    pristine = (tiny_workdir / "experts.bin").read_bytes()[layer0]
    try:
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        with open(w.experts_path, "r+b") as f:  # every block of layer 0 zeroed under the running server
            f.seek(layer0.start)
            f.write(bytes(len(pristine)))
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code >= 500
        message = r.json()["error"]["message"]
        assert re.search(
            r"expert block \(layer 0, expert \d+\) read from .* does not match its crc32c", message
        )
        assert "run `expertstream verify --all` and set up again" in message
        with open(w.experts_path, "r+b") as f:  # repaired: the server serves again, nothing bad was kept
            f.seek(layer0.start)
            f.write(pristine)
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
    finally:
        server.stop()
        engine.close()


def _fails_in_one_sentence(capsys, *argv: str) -> str:
    assert cli_main(list(argv)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"expertstream {argv[0]}: error: ")
    return last


def test_a_changed_config_json_is_refused_in_one_sentence(wd, capsys):
    text = (wd / "config.json").read_text()
    assert '"rms_norm_eps": 1e-06' in text
    (wd / "config.json").write_text(
        text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 2e-06')
    )  # same size
    with pytest.raises(WorkdirError) as e:
        Workdir(wd)
    assert str(e.value) == (
        f"{wd / 'config.json'} does not match the {ALGORITHM} setup recorded: it changed after setup: {AGAIN}"
    )
    assert str(wd / "config.json") in _fails_in_one_sentence(capsys, "generate", str(wd), "--prompt", "hi")


def test_a_broken_tokenizer_json_is_refused_in_one_sentence(tiny_snapshot, wd, tmp_path, capsys):
    (wd / "tokenizer.json").write_text('{"version": "1.0", "model": ')  # cut short
    last = _fails_in_one_sentence(capsys, "generate", str(wd), "--prompt", "hi")
    assert f"{wd / 'tokenizer.json'} has " in last and f"it changed after setup: {AGAIN}" in last
    # broken in the snapshot already: setup refuses it before writing anything
    snap = shutil.copytree(tiny_snapshot, tmp_path / "snap")
    (snap / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(SetupError, match=r"tokenizer.json is not a tokenizer the `tokenizers` library reads"):
        setup_workdir(snap, tmp_path / "wd2", progress=False)
    assert not (tmp_path / "wd2").exists()


def test_a_missing_file_or_tensor_is_refused_in_one_sentence(wd, capsys):
    (wd / "chat_template.jinja").unlink()
    last = _fails_in_one_sentence(capsys, "generate", str(wd), "--prompt", "hi")
    assert f"{wd / 'chat_template.jinja'} is missing from the working directory: {AGAIN}" in last
    # a resident file without one tensor, recorded consistently in the manifest: the tensor is named
    (wd / "chat_template.jinja").write_text("")
    tensors = load_file(wd / "resident.safetensors")
    del tensors["layers.3.mlp.gate.weight"]
    save_file(tensors, wd / "resident.safetensors")
    manifest = json.loads((wd / MANIFEST).read_text())
    for name in ("resident.safetensors", "chat_template.jinja"):
        size, crc = file_checksum(wd / name)
        manifest["files"][name] = {"bytes": size, ALGORITHM: crc}
    write_manifest(wd, manifest)
    with pytest.raises(WorkdirError) as e:
        Workdir(wd)
    assert str(e.value) == f"resident.safetensors: tensor layers.3.mlp.gate.weight is missing: {AGAIN}"
    assert "layers.3.mlp.gate.weight is missing" in _fails_in_one_sentence(
        capsys, "generate", str(wd), "--prompt", "hi"
    )
