"""The CPU share of GPU decode (experts/split_bank.py): the GPU bank runs through the Triton interpreter on
the CPU, the CPU share through the C kernel, against the torch bank."""

import pytest
import torch
from bank_helpers import ram_store

from expertstream.experts.cpu_bank import StreamedExperts
from expertstream.experts.gpu_bank import GpuExperts
from expertstream.experts.split_bank import (
    SPARE_CORES,
    SplitExperts,
    SplitTimes,
    cpu_experts,
    expert_seconds,
    send_capturable,
    split_threads,
    weighed_experts,
)
from expertstream.kernels import cpu_moe
from expertstream.store import ExpertStore
from expertstream.workdir.workdir import Workdir

pytest.importorskip("triton")  # conftest runs it through the interpreter when there is no CUDA
needs_kernel = pytest.mark.skipif(cpu_moe.library() is None, reason="no C compiler to build the CPU kernel")


def test_the_share_balances_the_two_sides():
    assert cpu_experts(10, cpu_gbps=55.0, bus_gbps=55.0) == 5
    # 2 on the CPU: 0.1 against the bus's 8 / 55 = 0.145; 3: 0.15 (the CPU's side the slower)
    assert cpu_experts(10, cpu_gbps=20.0, bus_gbps=55.0) == 2
    assert cpu_experts(10, cpu_gbps=1.0, bus_gbps=55.0) == 0
    assert cpu_experts(10, cpu_gbps=0.0, bus_gbps=55.0) == 0
    assert cpu_experts(8, cpu_gbps=1e3, bus_gbps=1.0) == 8


def test_the_bus_alone_is_weighed_at_its_own_rate():
    block = 1_000_000  # 10 blocks at 50 GB/s: 0.2 ms; 4 of them at 40 GB/s: 0.1 ms against the bus's 0.12
    assert expert_seconds(10, 0, block, 40.0, 50.0) == pytest.approx(2e-4)
    assert expert_seconds(10, 4, block, 40.0, 50.0) == pytest.approx(1.2e-4)
    assert expert_seconds(10, 4, block, 0.0, 50.0) == float("inf")
    assert cpu_experts(10, 40.0, 50.0, block) == 4
    # the bus at 20 GB/s beside the CPU: 7 on the CPU (0.175 ms) against 3 in 0.15 ms, below 0.2 alone
    assert cpu_experts(10, 40.0, 20.0, block, alone_gbps=50.0) == 7
    # at 5 GB/s beside it: 9 on the CPU take 0.225 ms; the bus alone at 50 GB/s wins
    assert cpu_experts(10, 40.0, 5.0, block, alone_gbps=50.0) == 0
    assert cpu_experts(10, 40.0, 5.0, block) == 9  # weighed at 5 GB/s, the bus alone would lose


def test_the_weighed_share_of_a_measured_h100_box():
    # host B of docs/benchmarks.md, 6 of 10 experts on the CPU, a layer: the CPU's call 0.2825 ms, the
    # GPU's share of 4 blocks 0.2575 ms, then 0.23 ms waiting for the CPU's sum; 4 of 10 measured best
    call, share, waited = 0.2825e-3, 0.2575e-3, 0.23e-3
    fixed = share + waited - call
    assert weighed_experts(10, call / 6, share / 4, fixed, alone=10 * 2.76e6 / 55e9) == 4
    assert weighed_experts(10, call / 6, share / 4, 0.0, alone=10 * 2.76e6 / 55e9) == 6  # rates alone


def test_the_split_threads_leave_cores_to_the_decode_thread():
    class Threads:  # a CpuThreads: `--threads` in fixed, the free cores when called
        def __init__(self, fixed, free):
            self.fixed, self.free = fixed, free

        def __call__(self):
            return self.fixed or self.free

    assert split_threads(Threads(0, 16))() == 16 - SPARE_CORES
    assert split_threads(Threads(0, 2))() == 1
    assert split_threads(Threads(8, 16))() == 8  # set by hand: kept


def test_split_times_add_up_and_subtract():
    a = SplitTimes(calls=4, launches=3, launch=1.0, wait=2.0, kernel=3.0, timed=2, gpu_share=1.0)
    b = SplitTimes(calls=1, launch=0.5, wait=1.0, kernel=1.0)
    assert a.host == 6.0
    d = a - b
    assert (d.calls, d.launches, d.launch, d.wait, d.kernel, d.timed, d.gpu_share) == (
        3,
        3,
        0.5,
        1.0,
        2.0,
        2,
        1.0,
    )


def routing(wd, t, seed):
    g = torch.Generator().manual_seed(seed)
    k = wd.text_config["num_experts_per_tok"]
    ids = torch.stack([torch.randperm(wd.num_experts, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return torch.randn(t, wd.layout.hidden_size, generator=g), ids, w / w.sum(-1, keepdim=True)


@needs_kernel
@pytest.mark.parametrize("copy", [True, False], ids=["copied", "in_place"])
def test_split_decode_equals_the_torch_bank(tiny_workdir, host_alloc, kernel_device, copy):
    wd = Workdir(tiny_workdir)
    k = wd.text_config["num_experts_per_tok"]
    blocks = wd.num_layers * wd.num_experts
    with ExpertStore(wd, blocks * wd.layout.block_bytes, io_threads=2, **host_alloc) as store:
        ref = StreamedExperts(wd, store, torch.float32)
        gpu = GpuExperts(wd, store, 8 + k * copy, kernel_device, copy_rows=k * copy)
        bank = SplitExperts(gpu, wd, share=0.5, threads=lambda: 2)
        assert bank.n_cpu == round(0.5 * k) and bank.copies == copy and gpu.cache.n_slots == 8
        # before every block has a RAM row it is the GPU bank, staged
        assert not bank.splitting and bank.decode_mode == "staged"
        for h in store.request([(layer, e) for layer in range(wd.num_layers) for e in range(wd.num_experts)]):
            h.wait()
            h.release()
        x, ids, w = routing(wd, 20, seed=1)
        prompt = bank(0, *(v.to(kernel_device) for v in (x, ids, w))).cpu()  # the GPU bank adopts the rows
        torch.testing.assert_close(
            prompt, ref(0, x, ids, w), rtol=2e-5, atol=2e-5 * prompt.abs().max().item()
        )
        assert bank.resident == "ram" and bank.splitting and bank.decode_mode == "split"
        syncs, before, t0, g0 = bank.host_syncs, bank.counters(), bank.split_times(), gpu.decode_seconds
        bank.gpu_timing = kernel_device == "cuda"
        for layer in range(wd.num_layers):
            x, ids, w = routing(wd, 1, seed=10 + layer)
            got = bank(layer, *(v.to(kernel_device) for v in (x, ids, w))).cpu()
            want = ref(layer, x, ids, w)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
            # the GPU's share was copied into the copy rows (after the cache's), in its order
            rows = gpu.cache.slots[gpu.cache.n_slots : gpu.cache.n_slots + k - bank.n_cpu].cpu()
            blocks = gpu.host_blocks[gpu.ram_rows(layer)[ids[0, : k - bank.n_cpu]]]
            assert torch.equal(rows, blocks) == copy
        assert bank.cpu_blocks == wd.num_layers * bank.n_cpu  # each layer's share ran on the CPU
        t, after = bank.split_times() - t0, bank.counters()
        # a launch between each pair of consecutive split layers
        assert t.calls == wd.num_layers and t.launches == wd.num_layers - 1
        assert min(t.launch, t.wait, t.kernel) > 0
        assert len(bank.kernel_log) == t.calls and sum(bank.kernel_log) == pytest.approx(t.kernel)
        # the split layers' phases are the bank's decode time, the wait for x its sync time
        decode = after.bank_decode_seconds - before.bank_decode_seconds
        assert decode == pytest.approx(t.host + gpu.decode_seconds - g0)
        assert after.bank_sync_seconds - before.bank_sync_seconds == pytest.approx(t.wait)
        if kernel_device == "cuda":  # every layer's GPU times; dense work between each consecutive pair
            assert t.timed == wd.num_layers and t.dense_gaps == wd.num_layers - 1
            assert min(t.gpu_share, t.gpu_idle, t.gpu_dense) > 0
        assert bank.host_syncs == syncs + wd.num_layers  # one read-back a layer
        assert bank.counters().resident_ram_reads == wd.num_layers * (k - bank.n_cpu)  # the bus's share
        # every expert on the CPU: the GPU kernel is not launched at all; the decode graphs capture anew
        key = bank.decode_key
        bank.n_cpu = k
        assert bank.decode_key != key
        x, ids, w = routing(wd, 1, seed=99)
        got = bank(2, *(v.to(kernel_device) for v in (x, ids, w))).cpu()
        torch.testing.assert_close(got, ref(2, x, ids, w), rtol=2e-5, atol=2e-5 * got.abs().max().item())
        bank.close()


def test_a_zero_share_is_the_gpu_bank(tiny_workdir, host_alloc, kernel_device):
    wd = Workdir(tiny_workdir)
    with ExpertStore(wd, 1 << 20, io_threads=2, **host_alloc) as store:
        gpu = GpuExperts(wd, store, 8, kernel_device)
        bank = SplitExperts(gpu, wd, share=0.0, threads=lambda: 1)
        assert bank.n_cpu == 0 and not bank.splitting and bank.decode_mode == gpu.decode_mode
        assert bank.cache is gpu.cache  # anything else is the GPU bank's
        bank.close()


@needs_kernel
def test_the_auto_share_turns_off_where_its_host_work_outweighs_the_bus(
    tiny_workdir, host_alloc, kernel_device
):
    wd = Workdir(tiny_workdir)
    layers, k = wd.num_layers, wd.text_config["num_experts_per_tok"]
    blocks = layers * wd.num_experts
    with ExpertStore(wd, blocks * wd.layout.block_bytes, io_threads=2, **host_alloc) as store:
        ref = StreamedExperts(wd, store, torch.float32)
        gpu = GpuExperts(wd, store, 8, kernel_device)
        # a CPU rate claimed at start that makes the CPU take every expert; in place the host work of a
        # split layer (tens of microseconds at least) is far more than k tiny blocks take at 100 GB/s
        bank = SplitExperts(gpu, wd, share=-1.0, threads=lambda: 1, bus_gbps=100.0, cpu_gbps=1e6)
        assert bank.n_cpu == k and bank.adapt_calls == (layers, 3 * layers)
        for h in store.request([(layer, e) for layer in range(layers) for e in range(wd.num_experts)]):
            h.wait()
            h.release()
        x, ids, w = routing(wd, 4, seed=1)
        bank(0, *(v.to(kernel_device) for v in (x, ids, w)))  # a prompt: the GPU bank adopts the rows
        assert bank.splitting
        # the first split token starts at layer 1: the share is weighed between tokens, at a last layer
        # past the 3L-th call (a token's program keeps one share throughout)
        for call in range(4 * layers):
            layer = (call + 1) % layers
            x, ids, w = routing(wd, 1, seed=20 + call)
            got = bank(layer, *(v.to(kernel_device) for v in (x, ids, w))).cpu()
            want = ref(layer, x, ids, w)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
            assert bank.splitting == (call + 1 < 4 * layers - 1)
        assert bank.n_cpu == 0 and bank.adapt_calls is None and bank.decode_mode == gpu.decode_mode
        assert bank.split_times().calls == 4 * layers - 1
        bank.close()


@needs_kernel
def test_the_auto_share_moves_to_the_best_share_at_the_rates_in_place(
    tiny_workdir, host_alloc, kernel_device
):
    wd = Workdir(tiny_workdir)
    k, payload = wd.text_config["num_experts_per_tok"], wd.layout.payload_bytes
    with ExpertStore(wd, 1 << 20, io_threads=2, **host_alloc) as store:
        # K = 4; a CPU as fast as the bus (50 GB/s) at start takes half
        bank = SplitExperts(GpuExperts(wd, store, 8, kernel_device), wd, share=-1.0, threads=lambda: 1,
                            bus_gbps=50.0, cpu_gbps=50.0)  # fmt: skip
        assert k == 4 and bank.n_cpu == 2

        def weigh(cpu_gbps, bus_gbps, idle=0.0):  # 10 split layers at those rates in place, n = 2
            bank.n_cpu = 2
            n_bytes = 2 * payload * 10
            bank.weigh(SplitTimes(calls=10, kernel=n_bytes / cpu_gbps / 1e9, timed=10,
                                  gpu_share=n_bytes / bus_gbps / 1e9, gpu_idle=10 * idle))  # fmt: skip
            return bank.n_cpu

        # 2 blocks each side at 30 GB/s (2 / 30) beat the bus alone's 4 at 50 (4 / 50)
        assert weigh(30.0, 30.0) == 2
        # the CPU at 60 and the bus at 20 beside it: 3 on the CPU (3 / 60 against 1 / 20)
        assert weigh(60.0, 20.0) == 3
        # the CPU at 60, the GPU at 40: 2 each side (2 / 40 against 3 / 60: the smaller on the tie)
        assert weigh(60.0, 40.0) == 2
        # ... where the GPU then waited 0.03 (in payload / 1e9 s) for the CPU's sum, the CPU side costs 0.05
        # + 0.03 - 2 / 60 = 0.0467 beyond its blocks (its wake): 1 on the CPU, max(0.0467 + 1 / 60, 3 / 40)
        # = 0.075, beats 2, 0.0467 + 2 / 60 = 0.08 (and the bus alone, 4 / 50 = 0.08)
        assert weigh(60.0, 40.0, idle=0.03 * payload / 1e9) == 1
        # the CPU at 10: its one block (1 / 10) is slower than the bus alone's 4 (4 / 50): off
        assert weigh(10.0, 40.0) == 0
        assert not bank.splitting
        bank.close()


@needs_kernel
@pytest.mark.parametrize(  # the eager send (a GPU that cannot capture it): slow under the interpreter
    "send_in_graph", [pytest.param(False, marks=pytest.mark.slow), True], ids=["eager-send", "captured-send"]
)
def test_the_split_stages_equal_the_layers_forward(tiny_workdir, kernel_device, send_in_graph):
    """The decode graphs' stages of a split layer (x to the host eager or graphable, the CPU's share eager,
    the GPU's share and the sum graphable), run eagerly, give the layers' own forward bit for bit."""
    from test_decode_graphs import continue_greedy, layers_step

    from expertstream.config import EngineConfig
    from expertstream.runtime.decode_graphs import DecodeGraphs
    from expertstream.runtime.engine import Engine
    from expertstream.store.reader import pinned_alloc

    cfg = EngineConfig(model=str(tiny_workdir), device=kernel_device, max_model_len=512, gpu_memory_gb=4)
    eng = Engine(cfg)
    wd, a = eng.workdir, eng.args
    store = ram_store(wd, alloc=pinned_alloc)
    gpu = GpuExperts(wd, store, 40, eng.device, copy_rows=a.num_experts_per_tok)
    bank = SplitExperts(gpu, wd, share=0.5, threads=lambda: 2)
    for layer in eng.model.layers:
        layer.mlp.bank = bank
    prompt = [3 + i % 50 for i in range(20)]
    want, _ = continue_greedy(eng, prompt, 4, step=layers_step(eng))  # the prompt adopts the RAM rows
    assert bank.decode_mode == "split"
    bank.captured_send = send_in_graph  # as the CUDA probe (`send_capturable`) finds
    runs = DecodeGraphs(eng.model, capture=False).program(eng.new_state(), kv_len=256)
    eager = sum(len(stages) for graphable, stages in runs if not graphable)
    # host inputs, QSA selections, and per layer the CPU's share (and x to the host unless captured)
    per_layer = 1 if send_in_graph else 2
    assert eager == 1 + sum(t != "linear_attention" for t in a.layer_types) + per_layer * a.num_hidden_layers
    program, calls, reads = DecodeGraphs(eng.model, capture=False), bank.times.calls, bank.resident_reads
    got, _ = continue_greedy(
        eng, prompt, 4, step=lambda st, t: eng.model.logits(program.step(torch.tensor([t]), st))[0]
    )
    assert torch.equal(got, want)
    assert bank.times.calls - calls == 4 * a.num_hidden_layers  # one split call a layer and token
    assert bank.resident_reads - reads == 4 * a.num_hidden_layers * (a.num_experts_per_tok - bank.n_cpu)
    bank.close()
    store.close()
    eng.close()


@needs_kernel
def test_with_staged_guesses_the_cpu_takes_what_would_cross_the_bus(tiny_workdir, kernel_device):
    """With the next layer's guesses staged to VRAM, a split layer's experts are ordered with those the GPU
    reads from VRAM first: the CPU's last n are blocks that would otherwise cross the bus. The decode
    program (staging stages included) gives the layers' own forward (which stages nothing, so its experts
    split otherwise) to FP32 rounding, and the same tokens."""
    from test_decode_graphs import continue_greedy, layers_step

    from expertstream.config import EngineConfig
    from expertstream.runtime.decode_graphs import DecodeGraphs
    from expertstream.runtime.engine import Engine
    from expertstream.store.reader import pinned_alloc

    cfg = EngineConfig(model=str(tiny_workdir), device=kernel_device, max_model_len=512, gpu_memory_gb=4)
    eng = Engine(cfg)
    wd, a = eng.workdir, eng.args
    k = a.num_experts_per_tok
    store = ram_store(wd, alloc=pinned_alloc)
    gpu = GpuExperts(wd, store, 40, eng.device, stage_guesses=k // 2, copy_rows=k)
    gpu.set_router_weights({i: layer.mlp.gate.weight for i, layer in enumerate(eng.model.layers)})
    bank = SplitExperts(gpu, wd, share=0.5, threads=lambda: 2)
    for layer in eng.model.layers:
        layer.mlp.bank = bank
    prompt = [3 + i % 50 for i in range(20)]
    want, _ = continue_greedy(eng, prompt, 4, step=layers_step(eng))  # the prompt adopts the RAM rows
    assert bank.decode_mode == "split" and bank.stage_guesses == k // 2
    orders, send = [], bank.split_send

    def spy(layer, x, ids, w):  # split_send's order: VRAM-read experts first, each part in top-k order
        send(layer, x, ids, w)
        vram = gpu.decode_in_vram(layer, ids[0]).tolist()
        routed = ids[0].tolist()
        first = [e for e, v in zip(routed, vram) if v] + [e for e, v in zip(routed, vram) if not v]
        orders.append((bank._ids[0].tolist() == first, sum(vram)))

    bank.split_send = spy
    program, staged = DecodeGraphs(eng.model, capture=False), gpu.stage_counts()[0]
    got, _ = continue_greedy(
        eng, prompt, 4, step=lambda st, t: eng.model.logits(program.step(torch.tensor([t]), st))[0]
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert len(orders) == 4 * a.num_hidden_layers and all(ok for ok, _ in orders)
    assert gpu.stage_counts()[0] > staged and any(hits for _, hits in orders)  # guesses were staged and hit
    bank.close()
    store.close()
    eng.close()


@pytest.mark.gpu  # CUDA graphs need a GPU
def test_split_decode_in_graphs_equals_eager_on_cuda(tiny_workdir):
    from test_decode_graphs import continue_greedy

    from expertstream.config import EngineConfig
    from expertstream.runtime.engine import Engine

    outs = []
    for eager in (True, False):
        cfg = EngineConfig(model=str(tiny_workdir), device="cuda", max_model_len=512, gpu_memory_gb=4,
                           ram_cache_gb=1, cpu_moe_share=0.5, enforce_eager=eager)  # fmt: skip
        eng = Engine(cfg, vram_cache_blocks=0)  # every block read from RAM: the bank adopts the RAM rows
        wd = eng.workdir
        for h in eng.store.request([(i, e) for i in range(wd.num_layers) for e in range(wd.num_experts)]):
            h.wait()
            h.release()
        rows, _ = continue_greedy(eng, [3 + i % 50 for i in range(40)], 12)
        assert eng.bank.decode_mode == "split" and eng.bank.times.calls == 12 * wd.num_layers
        assert eng.bank.send_in_graph  # the graphs hold the send: one eager point a layer
        assert eng.bank.copies  # the engine gives the GPU's share rows to copy its blocks into
        outs.append(rows)
        eng.close()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@pytest.mark.gpu
def test_the_send_capture_probe_finds_a_capturing_device():
    assert send_capturable(torch.device("cuda"))
