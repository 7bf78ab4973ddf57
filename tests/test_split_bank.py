"""The CPU share of GPU decode (experts/split_bank.py): the GPU bank runs through the Triton interpreter on
the CPU, the CPU share through the C kernel, against the torch bank."""

import dataclasses

import pytest
import torch
from bank_helpers import ram_store

from expertstream.experts.cpu_bank import StreamedExperts
from expertstream.experts.gpu_bank import GpuExperts
from expertstream.experts.split_bank import (
    FORGET_WINDOWS,
    RETIME,
    SPARE_CORES,
    TUNE_TOKENS,
    WATCH_TOKENS,
    ShareTuner,
    SplitExperts,
    SplitTimes,
    cpu_experts,
    expert_seconds,
    split_threads,
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
    # 4 of the 10 read from VRAM: the bus carries 6 alone, 6 - n beside the CPU's n
    assert expert_seconds(10, 0, block, 40.0, 50.0, in_vram=4) == pytest.approx(1.2e-4)
    assert expert_seconds(10, 2, block, 40.0, 50.0, in_vram=4) == pytest.approx(8e-5)
    assert expert_seconds(10, 8, block, 40.0, 50.0, in_vram=4) == pytest.approx(2e-4)  # 2 of them VRAM's
    assert cpu_experts(10, 40.0, 50.0, block, in_vram=4) == 3


def test_the_split_threads_leave_cores_to_the_decode_thread():
    class Threads:  # a CpuThreads: `--threads` in fixed, the free cores when called
        def __init__(self, fixed, free):
            self.fixed, self.free = fixed, free

        def __call__(self):
            return self.fixed or self.free

    assert split_threads(Threads(0, 16))() == 16 - SPARE_CORES
    assert split_threads(Threads(0, 2))() == 1
    assert split_threads(Threads(8, 16))() == 8  # set by hand: kept


def test_split_times_subtract():
    a = SplitTimes(calls=4, kernel=3.0, timed=2, gpu_share=1.0, gpu_idle=0.5, gpu_dense=2.0, dense_gaps=1)
    d = a - SplitTimes(calls=1, kernel=1.0, gpu_idle=0.25)
    assert dataclasses.astuple(d) == (3, 2.0, 2, 1.0, 0.25, 2.0, 1)


def routing(wd, t, seed):
    g = torch.Generator().manual_seed(seed)
    k = wd.text_config["num_experts_per_tok"]
    ids = torch.stack([torch.randperm(wd.num_experts, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return torch.randn(t, wd.layout.hidden_size, generator=g), ids, w / w.sum(-1, keepdim=True)


@needs_kernel
@pytest.mark.parametrize("how", ["kernel", "in_place"])
def test_split_decode_equals_the_torch_bank(tiny_workdir, host_alloc, kernel_device, how):
    """The GPU's share copied into its copy rows by a kernel, or read in place."""
    wd = Workdir(tiny_workdir)
    k = wd.text_config["num_experts_per_tok"]
    blocks = wd.num_layers * wd.num_experts
    copy = how != "in_place"
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
        syncs, t0 = bank.host_syncs, bank.split_times()
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
        t = bank.split_times() - t0
        assert t.calls == wd.num_layers and t.kernel > 0  # the server answered each layer
        assert sum(bank.kernel_log(t.calls)) == pytest.approx(t.kernel)
        if kernel_device == "cuda":  # every layer's GPU times; dense work between each consecutive pair
            assert t.timed == wd.num_layers and t.dense_gaps == wd.num_layers - 1
            assert min(t.gpu_share, t.gpu_idle, t.gpu_dense) > 0
        assert bank.host_syncs == syncs  # nothing is read back: the request and its answer meet in RAM
        assert bank.counters().resident_ram_reads == wd.num_layers * (k - bank.n_cpu)  # the bus's share
        # every expert on the CPU: the GPU kernel is not launched at all; the decode graphs capture anew
        key = bank.decode_key
        bank.n_cpu = k
        assert bank.decode_key != key
        x, ids, w = routing(wd, 1, seed=99)
        got = bank(2, *(v.to(kernel_device) for v in (x, ids, w))).cpu()
        torch.testing.assert_close(got, ref(2, x, ids, w), rtol=2e-5, atol=2e-5 * got.abs().max().item())
        bank.close()


@needs_kernel
def test_split_decode_of_mxfp4_experts_with_the_swiglu_limit(ds4_tiny, host_alloc, kernel_device):
    """DeepSeek-V4's experts: the server's share reads MXFP4 blocks and clamps as the GPU bank does (a limit
    these rows reach: without it the torch bank's answer changes)."""
    wd, lim = Workdir(ds4_tiny(0)[1]), 0.05
    k, blocks = wd.text_config["num_experts_per_tok"], wd.num_layers * wd.num_experts
    with ExpertStore(wd, blocks * wd.layout.block_bytes, io_threads=2, **host_alloc) as store:
        ref = StreamedExperts(wd, store, torch.float32, swiglu_limit=lim)
        free = StreamedExperts(wd, store, torch.float32)
        gpu = GpuExperts(wd, store, 8 + k, kernel_device, swiglu_limit=lim, copy_rows=k)
        bank = SplitExperts(gpu, wd, share=0.5, threads=lambda: 2)
        keys = [(layer, e) for layer in range(wd.num_layers) for e in range(wd.num_experts)]
        for h in store.request(keys):
            h.wait()
            h.release()
        bank(0, *(v.to(kernel_device) for v in routing(wd, 4, seed=1)))  # the GPU bank adopts the rows
        assert bank.splitting and 0 < bank.n_cpu < k
        for layer in range(wd.num_layers):
            x, ids, w = routing(wd, 1, seed=10 + layer)
            got = bank(layer, *(v.to(kernel_device) for v in (x, ids, w))).cpu()
            want = ref(layer, x, ids, w)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
            assert not torch.allclose(want, free(layer, x, ids, w), rtol=1e-3, atol=1e-3)
        assert bank.cpu_blocks == wd.num_layers * bank.n_cpu
        bank.close()


def test_a_zero_share_is_the_gpu_bank(tiny_workdir, host_alloc, kernel_device):
    wd = Workdir(tiny_workdir)
    with ExpertStore(wd, 1 << 20, io_threads=2, **host_alloc) as store:
        gpu = GpuExperts(wd, store, 8, kernel_device)
        bank = SplitExperts(gpu, wd, share=0.0, threads=lambda: 1)
        assert bank.n_cpu == 0 and not bank.splitting and bank.decode_mode == gpu.decode_mode
        assert bank.cache is gpu.cache  # anything else is the GPU bank's
        bank.close()


def tune(tuner: ShareTuner, token_seconds) -> list[int]:
    """Feed `tuner` tokens timed by token_seconds(n) until it settles -> the shares it ran, in order."""
    ran = [tuner.n]
    for _ in range(200):
        if tuner.settled:
            return ran
        n = tuner.add(token_seconds(tuner.n))
        if n != ran[-1]:
            ran.append(n)
    raise AssertionError("the tuner never settled")


def test_the_tuner_descends_to_the_fastest_share():
    # a layer's time with n of 10 on the CPU: the slower of the two sides, fastest at 4
    cost = lambda n: max(0.05 + n * 0.2, (10 - n) * 0.15) if n else 10 * 0.15  # noqa: E731
    tuner = ShareTuner(10, n0=6)
    assert tune(tuner, cost) == [6, 7, 5, 4, 3, 4]  # down while faster, each neighbour of the best measured
    assert tuner.best() == 4 and set(tuner.times) == {3, 4, 5, 6, 7}
    # the bus alone is fastest: off, from the top; 1's median, twice 0's, is timed once more
    assert tune(ShareTuner(4, n0=4), lambda n: 1.0 + n) == [4, 3, 2, 1, 0, 1, 0]
    # a slow token among each share's TUNE_TOKENS (the median counts): the same choice
    noisy = ShareTuner(10, n0=6)
    seen: dict[int, int] = {}

    def jittery(n):
        seen[n] = seen.get(n, 0) + 1
        return cost(n) * (3.0 if seen[n] == 1 else 1.0)

    assert tune(noisy, jittery)[-1] == 4 and all(v == TUNE_TOKENS for v in seen.values())


def test_a_neighbour_whose_first_median_reads_far_slower_is_timed_again():
    """The first TUNE_TOKENS tokens at 5 are slow (a transient, as two first descents on an H100 box read
    8.6 and 9.8 ms at 5 of 10 beside 2.7-2.9 at 4): 5 is timed once more and kept. A neighbour that is
    slower on its second timing too is not timed a third time, and one within RETIME of the fastest never
    twice."""
    cost = {3: 3.0, 4: 2.8, 5: 2.6, 6: 2.75}
    seen: dict[int, int] = {}

    def transient(n):
        seen[n] = seen.get(n, 0) + 1
        return 9.5 if n == 5 and seen[n] <= TUNE_TOKENS else cost[n]

    tuner = ShareTuner(10, n0=4)
    assert tune(tuner, transient) == [4, 5, 3, 5, 6, 5] and tuner.best() == 5
    assert seen == {4: TUNE_TOKENS, 5: 2 * TUNE_TOKENS, 3: TUNE_TOKENS, 6: TUNE_TOKENS}
    slow = ShareTuner(10, n0=4)  # 5 really is slow: timed twice, then 4 is kept
    assert tune(slow, lambda n: {3: 3.0, 4: 2.8, 5: 9.5}[n]) == [4, 5, 3, 5, 4] and slow.best() == 4
    assert RETIME * 2.8 > 3.0  # 3 stays at its one median


def run_tokens(tuner: ShareTuner, token_seconds, tokens: int) -> list[int]:
    """Feed `tuner` `tokens` tokens timed by token_seconds(n, i) -> the n each token ran at."""
    ran = []
    for i in range(tokens):
        ran.append(tuner.n)
        tuner.add(token_seconds(tuner.n, i))
    return ran


def test_the_kept_share_is_watched_by_its_mean_and_left_when_slower():
    """A share whose few tokens' median is fastest but whose calls stall now and then (every 8th token 8x):
    the first descent keeps it, its first watch window's mean is slower than the bus alone's, and the tuner
    moves there and stays; the slow tokens count once a window, never more."""
    tuner = ShareTuner(4, n0=2)
    base = {0: 1.0, 1: 0.9, 2: 0.7, 3: 0.8, 4: 1.1}  # 4 within RETIME of 3: timed once
    stalls = lambda n, i: base[n] * (8.0 if n == 2 and i % 8 == 7 else 1.0)  # noqa: E731
    ran = run_tokens(tuner, stalls, 3 * TUNE_TOKENS + WATCH_TOKENS + 3 * TUNE_TOKENS)
    assert tuner.settled and ran[: 3 * TUNE_TOKENS] == [2] * 3 + [3] * 3 + [1] * 3  # the descent: keeps 2
    assert ran[3 * TUNE_TOKENS : 3 * TUNE_TOKENS + WATCH_TOKENS] == [2] * WATCH_TOKENS  # watched
    assert tuner.times[2] == pytest.approx(0.7 * (1 + 7 / 8))  # its mean: 1.31, slower than 1 and 3
    # 3 (0.8) is now the fastest measured: its unmeasured neighbour 4 is tried (1.1), then 3 is watched
    after = ran[3 * TUNE_TOKENS + WATCH_TOKENS :]
    assert after == [4] * TUNE_TOKENS + [3] * 2 * TUNE_TOKENS and tuner.times[4] == 1.1
    assert run_tokens(tuner, stalls, 3 * WATCH_TOKENS) == [3] * (3 * WATCH_TOKENS)  # and kept


def test_the_watch_measures_old_times_again_and_comes_back_when_the_box_frees():
    """Another process keeps the CPU busy while the tuner descends (every share slower than the bus alone:
    off), then leaves: once the shares' times are FORGET_WINDOWS windows old, the neighbour of the kept n is
    measured again, found faster, and the share is on again at the fastest n."""
    tuner = ShareTuner(4, n0=2)
    busy = {0: 1.0, 1: 1.1, 2: 1.3, 3: 1.6, 4: 2.0}
    free = {0: 1.0, 1: 0.8, 2: 0.6, 3: 0.7, 4: 0.9}
    load = {"now": busy}
    assert tune(tuner, lambda n: load["now"][n])[-1] == 0  # off: 2, 3, 1, 0 measured
    load["now"] = free
    ran = run_tokens(tuner, lambda n, i: load["now"][n], (FORGET_WINDOWS + 4) * WATCH_TOKENS)
    assert ran[: FORGET_WINDOWS * WATCH_TOKENS] == [0] * (FORGET_WINDOWS * WATCH_TOKENS)  # watched, kept
    assert tuner.n == 2 and tuner.times[2] == pytest.approx(0.6)  # back on at the fastest
    assert set(ran) == {0, 1, 2, 3}


@needs_kernel
def test_the_auto_share_tunes_itself_by_token_time(tiny_workdir, host_alloc, kernel_device):
    wd = Workdir(tiny_workdir)
    k = wd.text_config["num_experts_per_tok"]
    blocks = wd.num_layers * wd.num_experts
    with ExpertStore(wd, blocks * wd.layout.block_bytes, io_threads=2, **host_alloc) as store:
        ref = StreamedExperts(wd, store, torch.float32)
        gpu = GpuExperts(wd, store, 8, kernel_device)
        # the rates claimed at start make the CPU take every expert (K = 4)
        bank = SplitExperts(gpu, wd, share=-1.0, threads=lambda: 1, bus_gbps=100.0, cpu_gbps=1e6)
        assert k == 4 and bank.n_cpu == k and bank.tuning
        # no decode graphs to time the tokens (--enforce-eager): the rates' choice stays
        kept = SplitExperts(gpu, wd, share=-1.0, threads=lambda: 1, bus_gbps=100.0, cpu_gbps=1e6, tune=False)
        kept.decode_token_seconds(1.0)
        assert kept.n_cpu == k and not kept.tuning
        # the GPU's share weighed at its own rate while splitting: at the bus's 100 GB/s the CPU's 100 take 2
        # of the 4; where the share crosses at 50, 3 (0.03 against 0.02 of a block's GB) beat 2 (0.04)
        rates = dict(share=-1.0, threads=lambda: 1, bus_gbps=100.0, cpu_gbps=100.0, tune=False)
        assert SplitExperts(gpu, wd, **rates).n_cpu == 2
        assert SplitExperts(gpu, wd, **rates, share_gbps=50.0).n_cpu == 3
        bank.decode_token_seconds(1.0)  # before every block has a RAM row: not a token that could split
        assert bank.tuner.times == {} and not bank.tuner._samples
        for h in store.request([(layer, e) for layer in range(wd.num_layers) for e in range(wd.num_experts)]):
            h.wait()
            h.release()
        x, ids, w = routing(wd, 4, seed=1)
        bank(0, *(v.to(kernel_device) for v in (x, ids, w)))  # a prompt: the GPU bank adopts the rows
        assert bank.splitting
        decode_mode, ran = gpu.decode_mode, [bank.n_cpu]
        for token in range(40):  # every share splits correctly while tried; 4 ms a token, 1 more an expert
            x, ids, w = routing(wd, 1, seed=20 + token)
            got = bank(token % wd.num_layers, *(v.to(kernel_device) for v in (x, ids, w))).cpu()
            want = ref(token % wd.num_layers, x, ids, w)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
            if not bank.tuning:
                break
            bank.decode_token_seconds(1e-3 * (4 + bank.n_cpu))
            if bank.n_cpu != ran[-1]:
                ran.append(bank.n_cpu)
        # down to the bus alone, which the timed tokens found fastest: the GPU bank's own program
        assert ran == [4, 3, 2, 1, 0] and not bank.tuning
        assert bank.n_cpu == 0 and not bank.splitting and bank.decode_mode == decode_mode
        assert bank.split_times().calls == 4 * TUNE_TOKENS  # one call a token while it split
        bank.close()


@needs_kernel
def test_the_split_stages_equal_the_layers_forward(tiny_workdir, kernel_device):
    """The decode graphs' stages of a split layer (the request posted, the GPU's share, the answer taken: all
    graphable; the send and the take eager in timed tokens), run eagerly, give the layers' own forward bit
    for bit."""
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
    # host inputs and QSA selections: the split layers add no eager point, or two (send, take) when timed
    qsa = sum(t != "linear_attention" for t in a.layer_types)
    for timed, per_layer in ((True, 2), (False, 0)):
        bank.gpu_timing = timed
        runs = DecodeGraphs(eng.model, capture=False).program(eng.new_state(), kv_len=256)
        eager = sum(len(stages) for graphable, stages in runs if not graphable)
        assert eager == 1 + qsa + per_layer * a.num_hidden_layers
    program, calls, reads = (
        DecodeGraphs(eng.model, capture=False),
        bank.split_times().calls,
        bank.resident_reads,
    )
    got, _ = continue_greedy(
        eng, prompt, 4, step=lambda st, t: eng.model.logits(program.step(torch.tensor([t]), st))[0]
    )
    assert torch.equal(got, want)
    assert bank.split_times().calls - calls == 4 * a.num_hidden_layers  # one request a layer and token
    assert bank.resident_reads - reads == 4 * a.num_hidden_layers * (a.num_experts_per_tok - bank.n_cpu)
    bank.close()
    store.close()
    eng.close()


@needs_kernel
def test_the_split_stages_nothing_and_orders_vram_reads_first(tiny_workdir, kernel_device):
    """With a staging GPU bank, a splitting program stages no guesses (the bus carries the GPU's share beside
    the CPU's work instead), and a split layer's experts are ordered with those the GPU reads from VRAM (its
    hot set) first: the CPU's last n are blocks that would otherwise cross the bus. At n = 0 the GPU bank's
    staging is back. Both give the layers' own forward to FP32 rounding, and the same tokens."""
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
    assert bank.decode_mode == "split" and bank.stage_guesses == 0 and gpu.stage_guesses == k // 2
    assert gpu.residency.hot_quota > 0  # the slots the prompt passes leave hold a hot set
    orders, send = [], bank.split_send

    def spy(layer, x, ids, w):  # split_send's order: VRAM-read experts first, each part in top-k order
        send(layer, x, ids, w)
        vram = gpu.decode_in_vram(layer, ids[0]).tolist()
        routed = ids[0].tolist()
        first = [e for e, v in zip(routed, vram) if v] + [e for e, v in zip(routed, vram) if not v]
        orders.append((bank._ids[0].tolist() == first, sum(vram)))

    bank.split_send = spy
    step = lambda st, t: eng.model.logits(program.step(torch.tensor([t]), st))[0]  # noqa: E731
    program, staged = DecodeGraphs(eng.model, capture=False), gpu.stage_counts()[0]
    got, _ = continue_greedy(eng, prompt, 4, step=step)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert len(orders) == 4 * a.num_hidden_layers and all(ok for ok, _ in orders)
    assert any(hits for _, hits in orders)  # hot-set blocks were routed, and went to the GPU's side
    assert gpu.stage_counts()[0] == staged  # nothing staged while splitting
    bank.n_cpu = 0  # the GPU bank's own program: its staging is back
    assert bank.stage_guesses == k // 2 and bank.decode_mode == gpu.decode_mode
    program = DecodeGraphs(eng.model, capture=False)
    got, _ = continue_greedy(eng, prompt, 4, step=step)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert gpu.stage_counts()[0] > staged
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
        assert eng.bank.decode_mode == "split" and eng.bank.split_times().calls == 12 * wd.num_layers
        assert eng.bank.graphed  # the graphs hold the whole split layer
        assert eng.bank.copies  # the engine gives the GPU's share rows to copy its blocks into
        outs.append(rows)
        eng.close()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("share", [-1.0, 0.5])
def test_the_warm_up_compiles_each_share_decode_may_take(
    tiny_workdir, host_alloc, kernel_device, share, monkeypatch
):
    """A new share's GPU kernel compiled in decode stalled a token ~0.9 s on a cold Triton cache: the warm-up
    runs the GPU side's K - n experts with FP32 input for every n the auto share may move to (or the one set
    by hand), with the bank's SwiGLU clamp, as split_gpu calls it."""
    from expertstream.kernels import nvfp4_moe

    wd = Workdir(tiny_workdir)
    k = wd.text_config["num_experts_per_tok"]
    with ExpertStore(
        wd, wd.num_layers * wd.num_experts * wd.layout.block_bytes, io_threads=2, **host_alloc
    ) as s:
        gpu = GpuExperts(wd, s, 8 + k, kernel_device, copy_rows=k)
        bank = SplitExperts(gpu, wd, share=share, threads=lambda: 2, bus_gbps=50.0)
        calls, real = [], nvfp4_moe.nvfp4_moe_decode

        def decode(x, ids, *args, **kw):
            calls.append((x.dtype, ids.numel(), kw.get("swiglu_limit")))
            return real(x, ids, *args, **kw)

        monkeypatch.setattr(nvfp4_moe, "nvfp4_moe_decode", decode)
        bank.warm_up(torch.bfloat16)
        fp32 = sorted(n for dtype, n, _ in calls if dtype == torch.float32)
        assert fp32 == (list(range(1, k)) if share < 0 else [k - bank.n_cpu])
        assert all(limit == gpu.swiglu_limit for *_, limit in calls)
        bank.close()
