"""The Engine on a ds4-tiny working directory (MXFP4 experts from the store through StreamedExperts) against
models/deepseek_v4.py on the snapshot's own dequantized weights with dense experts."""

import json

import pytest
import torch

from expertstream.config import EngineConfig
from expertstream.experts.cpu_bank import DenseExperts
from expertstream.formats.snapshot import Snapshot
from expertstream.generate import SamplingParams, stream_generate
from expertstream.models import deepseek_v4 as ds4
from expertstream.runtime.engine import Engine


@pytest.fixture(scope="module")
def ds4_setup(ds4_tiny):
    return ds4_tiny(3)


def _engine(wd, **kw) -> Engine:
    return Engine(EngineConfig(model=str(wd), device="cpu", max_model_len=512, ram_cache_gb=0.01), **kw)


def _reference(snap_dir):
    snap = Snapshot(snap_dir)
    args = ds4.DeepseekV4Args.from_dict(snap.config)
    bank = DenseExperts(*ds4.dense_experts(snap, args), swiglu_limit=args.swiglu_limit)
    return ds4.DeepseekV4Model(args, ds4.load_weights(snap), bank), args


def _ids(t: int, vocab: int) -> torch.Tensor:
    return (torch.arange(t) * 11 + 5) % vocab


class CountingBank:
    """Wraps a bank and records which layers called it."""

    def __init__(self, bank):
        self.bank, self.layers = bank, []

    def __call__(self, layer, x, ids, w, **kw):
        self.layers.append(layer)
        return self.bank(layer, x, ids, w, **kw)

    def __getattr__(self, name):
        return getattr(self.bank, name)


def test_engine_equals_the_model_on_the_snapshot_prompt_and_decode(ds4_setup):
    snap, wd = ds4_setup
    ref, args = _reference(snap)
    ids = _ids(150, args.vocab_size)
    with torch.no_grad():
        want = ref.logits(ref(ids))
    engine = _engine(wd)
    try:
        # every MoE layer, hash-routed (0, 1) and top-k (2, 3), goes through the engine's streamed bank
        counting = CountingBank(engine.bank)
        for moe in engine.model.moe:
            moe.bank = counting
        state = engine.new_state()
        with torch.no_grad():
            prompt = engine.forward(state, ids[:140], all_logits=True)
            steps = [engine.forward(state, ids[t : t + 1]) for t in range(140, 150)]
        assert sorted(set(counting.layers)) == list(range(args.num_hidden_layers))
        assert args.num_hash_layers == 2
        got = torch.cat([prompt, torch.stack(steps)])
        assert (got - want).abs().max() <= 1e-3
        assert state.pos == 150 and state.tokens == ids.tolist()
        # a snapshot taken mid-conversation continues exactly as the original did
        snap_state = engine.new_state()
        engine.forward(snap_state, ids[:137])
        saved = snap_state.snapshot()
        a = engine.forward(snap_state, ids[137:139])
        snap_state.restore(saved)
        assert torch.equal(engine.forward(snap_state, ids[137:139]), a)
    finally:
        engine.close()


@pytest.mark.parametrize("control", ["swap-nibbles", "no-experts"])
def test_expert_controls_break_the_logits(ds4_setup, control):
    snap, wd = ds4_setup
    logits = {}
    for c in ("none", control):
        engine = _engine(wd, control=c)
        ids = _ids(60, engine.args.vocab_size)
        try:
            with torch.no_grad():
                logits[c] = engine.forward(engine.new_state(), ids, all_logits=True)
        finally:
            engine.close()
    assert (logits["none"] - logits[control]).abs().max() > 1.0


def test_generate_streams_text(ds4_setup):
    engine = _engine(ds4_setup[1])
    try:
        out = list(stream_generate(engine, "And God said", SamplingParams(max_tokens=6, temperature=0)))
    finally:
        engine.close()
    assert len(out) == 6 and out[-1].finish_reason == "length"


def test_bench_decode_runs_on_the_workdir(ds4_setup, capsys):
    from expertstream.cli import main as cli_main

    assert cli_main(["bench", "decode", "--model", str(ds4_setup[1]), "--tokens", "2", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["ram"]["ram_hit_rate"] == 1.0 and payload["ram"]["disk_bytes_per_token"] == 0
    assert payload["disk"]["tokens"] == payload["ram"]["tokens"]
    # on CUDA the CUDA bank's regimes, every block in a slot first; the CPU bank has no VRAM
    assert ("vram" in payload) == torch.cuda.is_available()


def _greedy(engine, prompt, n: int) -> torch.Tensor:
    """Logits [n + 1, V] of the prompt's last position and of n greedy tokens after it."""
    state = engine.new_state()
    with torch.no_grad():
        rows = [engine.forward(state, prompt)]
        for _ in range(n):
            rows.append(engine.forward(state, [int(rows[-1].argmax())]))
    return torch.stack(rows)


@pytest.mark.slow  # ~40 s under the Triton interpreter on 2 cores; seconds on a GPU
def test_the_cuda_bank_gives_the_eager_paths_tokens(ds4_setup, kernel_device, host_alloc):
    # the MXFP4 experts through the CUDA bank (the Triton kernels with V4's clamp; the interpreter on a CPU)
    # in place of the eager path's StreamedExperts: the same greedy tokens, logits within the engine test's
    # bound, with half the blocks in RAM (prompt passes, a fetch every decode layer) and with every block in
    # RAM (the bank adopts the fixed "ram" layout: decode reads RAM rows in place and stages guesses)
    pytest.importorskip("triton")
    from expertstream.experts.gpu_bank import GpuExperts
    from expertstream.store import ExpertStore

    _, wd = ds4_setup
    config = EngineConfig(model=str(wd), device=kernel_device, kernels="torch", dtype="float32",
                          max_model_len=512, ram_cache_gb=0.01)  # fmt: skip
    engine = Engine(config)
    prompt = _ids(24, engine.args.vocab_size).tolist()
    lim, layers, experts = engine.args.swiglu_limit, engine.workdir.num_layers, engine.workdir.num_experts
    keys = [(layer, e) for layer in range(layers) for e in range(experts)]
    blocks = len(keys)
    routers = {i: moe.gate for i, moe in enumerate(engine.model.moe)}
    # (RAM cache blocks, SwiGLU limit, staged guesses); must-fail control: a limit the tiny model's gate
    # and up rows reach (its own 10 they do not)
    runs = [(blocks // 2, lim, 0), (blocks, lim, 1), (blocks // 2, 0.05, 0)]
    got = []
    try:
        want = _greedy(engine, prompt, 4)
        layout = engine.workdir.layout
        assert layout.fmt == "mxfp4" and lim is not None
        for ram, limit, staged in runs:
            with ExpertStore(engine.workdir, ram * layout.block_bytes, io_threads=2, **host_alloc) as store:
                if ram == blocks:  # every block landed in RAM first, so that the bank can fix its layout
                    for h in store.request(keys):
                        h.wait()
                        h.release()
                bank = GpuExperts(engine.workdir, store, 6, kernel_device, stage_guesses=staged,
                                  swiglu_limit=limit)  # fmt: skip
                bank.set_router_weights(routers)
                for moe in engine.model.moe:
                    moe.bank = bank
                got.append(_greedy(engine, prompt, 4))
                assert bank.prefill_passes > layers
                assert bank.resident == ("ram" if ram == blocks else None)
                assert bank.host_syncs >= 4 * 4 if bank.resident is None else bank.stage_counts()[0] > 0
                bank.close()
    finally:
        engine.close()
    for run in got[:2]:
        assert torch.equal(run.argmax(-1), want.argmax(-1))
        assert (run - want).abs().max() <= 1e-3
    assert (got[2] - want).abs().max() > 1e-2


@pytest.mark.gpu
def test_the_engine_runs_ds4_through_the_cuda_bank(ds4_setup):
    # on CUDA the engine picks the CUDA bank for MXFP4 experts (eager decode: no decode stages for this
    # family), and its greedy tokens are the torch path's
    from expertstream.experts.gpu_bank import GpuExperts

    _, wd = ds4_setup
    runs = {}
    for kernels in ("auto", "torch"):
        config = EngineConfig(model=str(wd), device="cuda", kernels=kernels, dtype="float32",
                              max_model_len=512, gpu_memory_gb=4)  # fmt: skip
        engine = Engine(config)
        try:
            assert isinstance(engine.bank, GpuExperts) == (kernels == "auto") and engine.decode is None
            runs[kernels] = _greedy(engine, _ids(24, engine.args.vocab_size).tolist(), 4)
        finally:
            engine.close()
    assert torch.equal(runs["auto"].argmax(-1), runs["torch"].argmax(-1))
    assert (runs["auto"] - runs["torch"]).abs().max() <= 1e-3


@pytest.mark.parametrize("dtype,act", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_dense_surplus_is_what_the_model_holds_beyond_the_planned_weights(ds4_setup, dtype, act):
    # the CUDA engine plans VRAM with the budget the kernel path's weights leave: FP8 matrices and their
    # UE8M0 scales as stored, the embedding in host RAM, the other floats in the activation dtype
    from expertstream.formats.snapshot import read_header
    from expertstream.models.base import Linear
    from expertstream.workdir.workdir import Workdir

    wd = Workdir(ds4_setup[1])
    inventory = {n: (i.shape, i.dtype) for n, i in read_header(wd.resident_path).items()}
    tensors = wd.load_resident()
    weights = ds4.resident_weights(tensors, dtype, "cpu", (128, 128))
    held = sum(
        sum(b.numel() * b.element_size() for b in w.buffers())
        if isinstance(w, Linear)
        else w.numel() * w.element_size()
        for n, w in weights.items()
        if n != "embed.weight"
    )
    stored = sum(t.numel() * t.element_size() for n, t in tensors.items() if n != "embed.weight")
    assert any(isinstance(w, Linear) and w.weight.dtype == torch.float8_e4m3fn for w in weights.values())
    surplus = ds4.dense_surplus(inventory, act, "embed.weight")
    assert surplus == held - stored and (surplus < 0) == (dtype == torch.bfloat16)  # F32 tensors held BF16


@pytest.mark.slow  # ~9 s of kernels under the Triton interpreter on a CPU
def test_fp8_as_shipped_gives_the_dequantized_paths_tokens(ds4_setup, kernel_device, monkeypatch):
    # the kernel path keeps every FP8 matrix FP8 (the block-scaled kernel: on CUDA, or the interpreter on a
    # CPU) where kernels="torch" dequantizes them at load. In FP32 the in-register product
    # e4m3 x 2^(byte - 127) is the dequantized weight exactly (checked below), so only the FP32 sums' order
    # differs (the kernel's, the per-group grouped projection's): the greedy tokens are equal and the logits
    # within the 1e-3 the engine's other FP32 reorderings are held to.
    from expertstream.kernels import fp8_gemv
    from expertstream.kernels.fp8_gemv import dequantize_fp8_scaled
    from expertstream.models.base import Linear
    from expertstream.workdir.workdir import Workdir

    pytest.importorskip("triton")
    launches = []
    kernel = fp8_gemv.fp8_block_matmul
    monkeypatch.setattr(fp8_gemv, "fp8_block_matmul", lambda *a, **k: launches.append(1) or kernel(*a, **k))
    _, wd = ds4_setup
    stored = Workdir(wd).load_resident()
    dense = ds4.dequantized(stored, torch.float32)
    shipped_fp8 = sorted(n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn)
    runs = {}
    for kernels in ("torch", "triton"):
        config = EngineConfig(model=str(wd), device=kernel_device, kernels=kernels, dtype="float32",
                              max_model_len=512, ram_cache_gb=0.01, gpu_memory_gb=4)  # fmt: skip
        engine = Engine(config)
        try:
            fp8 = {n: w for n, w in engine.model.w.items() if isinstance(w, Linear)}
            for name, lin in fp8.items():
                assert lin.weight.dtype == torch.float8_e4m3fn and lin.block == (128, 128)
                w = dequantize_fp8_scaled(lin.weight.cpu(), lin.scale.cpu(), lin.block)
                assert torch.equal(w, dense[name]), name
            assert sorted(fp8) == (shipped_fp8 if kernels == "triton" else [])
            launches.clear()
            runs[kernels] = _greedy(engine, _ids(24, engine.args.vocab_size).tolist(), 4)
            assert bool(launches) == (kernels == "triton")
        finally:
            engine.close()
    assert torch.equal(runs["triton"].argmax(-1), runs["torch"].argmax(-1))
    assert (runs["triton"] - runs["torch"]).abs().max() <= 1e-3


def test_the_disk_regime_holds_two_layers_routed_experts(ds4_setup):
    """A quarter of a small model's blocks can be fewer than the K a layer holds at once (2 layers x 8
    experts, top-6: 4 blocks); the disk regime's RAM cache then holds two layers' K."""
    from types import SimpleNamespace

    from expertstream.bench.workdir_decode import regimes
    from expertstream.config import EngineConfig
    from expertstream.memory_plan import GiB
    from expertstream.workdir.workdir import Workdir

    wd = Workdir(ds4_setup[1])
    block = wd.layout.block_bytes
    top6 = {"num_experts_per_tok": 6}
    small = SimpleNamespace(layout=wd.layout, num_layers=2, num_experts=8, text_config=top6)
    for w, blocks in ((small, 12), (wd, wd.num_layers * wd.num_experts / 4)):
        cfg, vram = regimes(w, EngineConfig(model=str(wd.path)), cuda=False)["disk"]
        assert cfg.ram_cache_gb * GiB == pytest.approx(blocks * block) and vram == 0
