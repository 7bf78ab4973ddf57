"""Shared fixtures: a tiny synthetic snapshot in NVIDIA's layout and its working directory (built once),
random NVFP4 expert blocks for the kernel tests, and a live server in front of a scripted engine."""

import os

import pytest
import torch

# Triton kernels run in the interpreter on CPU-only machines (set before any kernel module imports triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests need CUDA: skipped without it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def kernel_device():
    """Where the GPU runtime's tests run: CUDA when present, else the CPU through the Triton interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def host_alloc(kernel_device):
    """The RAM cache's allocator as the engine picks it: pinned (readable by kernels) on CUDA."""
    if kernel_device == "cuda":
        from expertstream.store.reader import pinned_alloc

        return {"alloc": pinned_alloc}
    return {}


@pytest.fixture(scope="session")
def tiny_snapshot(tmp_path_factory):
    from expertstream.synth.synth import write_synthetic

    out = tmp_path_factory.mktemp("snap") / "tiny"
    write_synthetic(out, preset="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def full_shape_mtp_snapshot(tmp_path_factory):
    """One layer of the full-shape preset (4 experts) and its MTP layer: the real tensor shapes, read only."""
    from expertstream.synth.synth import write_synthetic

    return write_synthetic(
        tmp_path_factory.mktemp("snap") / "mtp", preset="full-shape", layers=1, experts=4, mtp=True
    )


@pytest.fixture(scope="session")
def tiny_workdir(tiny_snapshot, tmp_path_factory):
    from expertstream.workdir.repack import setup_workdir

    out = tmp_path_factory.mktemp("work") / "tiny"
    setup_workdir(tiny_snapshot, out)
    return out


@pytest.fixture(scope="session", params=[(64, 32), (96, 48)], ids=["h64i32", "h96i48"])
def moe_bank(request):
    """(layout, slots [6, block_bytes], ws2 [6, 3]): six random NVFP4 expert blocks of H x I on the kernels'
    device; 96 x 48 leaves partial groups and row blocks."""
    from kernel_helpers import random_slots

    from expertstream.formats.expert_block import ExpertLayout

    h, i = request.param
    layout = ExpertLayout.for_dims(h, i, align=64)
    slots, ws2 = random_slots(layout, 6, seed=h)
    return layout, slots, ws2


@pytest.fixture(scope="session", params=[(64, 32), pytest.param((96, 64), marks=pytest.mark.slow)],
                ids=["h64i32", "h96i64"])  # fmt: skip
def mx_bank(request):
    """(layout, slots [6, block_bytes], ws2 [6, 3]): six random MXFP4 expert blocks of H x I (DeepSeek-V4's
    format) on the kernels' device; ws2 random, which MXFP4 never reads. 96 x 64 leaves partial steps."""
    from kernel_helpers import random_slots

    from expertstream.formats.expert_block import ExpertLayout

    h, i = request.param
    layout = ExpertLayout.for_format("mxfp4", h, i, align=64)
    slots, ws2 = random_slots(layout, 6, seed=h + 7)
    return layout, slots, ws2


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_workdir):
    from expertstream.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_workdir)


@pytest.fixture(scope="session")
def scripted(tiny_tokenizer):
    """A live server in front of a scripted engine (server_helpers.scripted_server): a key, one request may
    wait, keepalives every 0.2 s, bodies up to 64 KiB."""
    from server_helpers import KEY, scripted_server

    server = scripted_server(
        tiny_tokenizer, api_key=KEY, max_queue=1, keepalive_s=0.2, max_body_bytes=64 << 10
    )
    yield server
    server.stop()


@pytest.fixture
def fake(scripted):
    """The scripted server writing its default text, left idle for the next test."""
    from server_helpers import wait_idle

    scripted.engine.configure()
    yield scripted
    wait_idle(scripted)
    scripted.engine.configure()


@pytest.fixture(scope="session")
def ds4_tiny(tmp_path_factory):
    """seed -> (snapshot, working directory) of a ds4-tiny model (DeepSeek-V4-Flash's published layout),
    made once a session each; read only."""
    from expertstream.synth.deepseek_v4 import write_synthetic_ds4
    from expertstream.workdir.repack import setup_workdir

    made = {}

    def make(seed: int):
        if seed not in made:
            root = tmp_path_factory.mktemp(f"ds4-{seed}")
            snap = write_synthetic_ds4(root / "snap", "ds4-tiny", seed=seed)
            made[seed] = snap, setup_workdir(snap, root / "wd", progress=False)
        return made[seed]

    return make
