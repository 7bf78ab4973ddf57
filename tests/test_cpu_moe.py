"""The CPU expert kernel (kernels/cpu_moe.c) against its plain-torch twin, on random NVFP4 expert blocks."""

import time

import pytest
import torch

from expertstream.formats import mxfp4, nvfp4
from expertstream.formats.expert_block import PROJ, ExpertLayout
from expertstream.kernels import cpu_moe

pytestmark = pytest.mark.skipif(cpu_moe.library() is None, reason="no C compiler to build the CPU kernel")


def random_blocks(layout: ExpertLayout, n: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """n random expert blocks in the layout's format (every E2M1 code and many block scales, E4M3 subnormals
    included) and their [n, 3] global scales (ones for MXFP4, which has none)."""
    g = torch.Generator().manual_seed(seed)
    h, i = layout.hidden_size, layout.intermediate_size
    blocks, ws2 = [], torch.empty(n, 3)
    for e in range(n):
        tensors = {}
        for j, (proj, shape) in enumerate(zip(PROJ, ((i, h), (i, h), (h, i)))):
            w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).pow(3)
            if layout.fmt == "mxfp4":
                (q, s), s2 = mxfp4.quantize(w), 1.0
            else:
                q, s, s2 = nvfp4.quantize(w)
            tensors[f"{proj}.weight"], tensors[f"{proj}.weight_scale"] = q, s
            ws2[e, j] = s2
        blocks.append(torch.frombuffer(bytearray(layout.pack(tensors)), dtype=torch.uint8))
    return blocks, ws2


def test_a_small_layer_takes_one_thread_and_a_large_one_all():
    """Threads are worth waking only for MIN_BYTES of blocks each: the demo model's four experts (25 KB
    each) run on the caller's thread, a full-shape layer's ten (2.7 MiB each) on every thread given."""
    demo, full = ExpertLayout.for_dims(256, 64), ExpertLayout.for_dims(2560, 640)
    assert cpu_moe.useful_threads(demo, 4, threads=2) == 1
    assert cpu_moe.useful_threads(full, 10, threads=14) == 14
    assert cpu_moe.useful_threads(full, 1, threads=14) == full.payload_bytes // cpu_moe.MIN_BYTES + 1
    assert cpu_moe.useful_threads(full, 10, threads=0) == 1


@pytest.mark.parametrize("t", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("threads", [1, 3])
def test_kernel_matches_twin(t, threads):
    layout = ExpertLayout.for_dims(96, 48)  # odd group counts (6 and 3): the unrolled loops' tails run
    blocks, ws2 = random_blocks(layout, 5, seed=t)
    g = torch.Generator().manual_seed(100 + t)
    x = torch.randn(t, 96, generator=g)
    wt = torch.rand(5, t, generator=g) * (torch.rand(5, t, generator=g) < 0.6)  # some tokens skip experts
    got = cpu_moe.moe(blocks, ws2, wt, x, layout, threads)
    want = cpu_moe.moe_twin(blocks, ws2, wt, x, layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_split_server_answers_posted_layers_from_its_tables():
    """The split server (the CPU share of split decode): a request posted into the mailbox (ids, weights and
    x in one FP32 buffer, the layer in the box) is answered from the [L, E] tables, equal to `moe` on the
    gathered blocks bit for bit, on a pool first made for more threads (its extra workers asleep) and on more
    again, and after the server slept; a request it refuses answers NaN with its code in box[ERR]."""
    from expertstream.kernels import mailbox

    layout = ExpertLayout.for_dims(96, 48)
    blocks, ws2 = random_blocks(layout, 12, seed=3)
    rows = torch.stack(blocks)  # [L * E, block_bytes]: two layers' rows, as in the RAM cache
    addr = (torch.arange(12, dtype=torch.long) * rows.stride(0) + rows.data_ptr()).view(2, 6)
    g = torch.Generator().manual_seed(4)
    ids, w, x = torch.tensor([4, 0, 5]), torch.rand(3, generator=g), torch.randn(96, generator=g)
    packed, out = torch.full((2 * cpu_moe.NMAX + 96,), float("nan")), torch.empty(96)
    box, seq = mailbox.new_box(pin=False), torch.zeros(1, dtype=torch.int32)
    server = cpu_moe.SplitServer(addr, ws2.view(2, 6, 3), packed, out, box, layout, threads=4, idle_s=1e-3)
    with pytest.raises(RuntimeError, match="already runs"):
        cpu_moe.SplitServer(addr, ws2.view(2, 6, 3), packed, out, box, layout, threads=1, idle_s=0)
    request = torch.cat((ids.float(), w, x))
    part = torch.randn(1, 96, generator=g)
    for layer, threads in ((1, 4), (0, 2), (1, 1), (0, 4)):
        server.arm(threads)
        seq += 1
        mailbox.post(request, packed, seq, box, layer, 3)
        e = ids + 6 * layer
        want = cpu_moe.moe([blocks[i] for i in e], ws2[e], w[:, None], x[None], layout, 1)
        assert torch.equal(mailbox.take(part, out, seq, box), part + want)
    time.sleep(0.01)  # past its idle spin: asleep, a request without an arm wakes it within 1 ms
    seq += 1
    mailbox.post(request, packed, seq, box, 0, 3)  # layer 0, as the last
    assert torch.equal(mailbox.take(part, out, seq, box), part + want)
    calls, kernel_s, last = server.stats(last=8)
    assert calls == 5 and len(last) == 5 and sum(last) == pytest.approx(kernel_s) and min(last) > 0
    for bad in (6.0, 0.5):  # no such expert in the layer; not an id
        request[1] = bad
        seq += 1
        mailbox.post(request, packed, seq, box, 0, 3)
        assert mailbox.take(part, out, seq, box).isnan().all() and box[mailbox.ERR] == 2
        box[mailbox.ERR] = 0
    server.close()
    server.close()  # once
    seq += 1  # nothing answers now: the take gives NaN and notes the request in box[FAIL]
    mailbox.post(request, packed, seq, box, 0, 3)
    assert mailbox.take_ref(part, out, seq, box, timeout_s=0.05).isnan().all()
    assert box[mailbox.FAIL] == seq


@pytest.mark.parametrize("kind", [0, 1])
def test_the_split_server_does_not_wait_for_a_parked_thread(kind):
    """A worker parked mid-item (the test's stall: 1 s, as the scheduler parks a thread for a slice): the
    server computes that item itself and answers each request in well under the stall, equal to `moe` bit for
    bit, requests after it too; once the parked thread wakes, its stale rows are dropped, not copied into the
    answer (kind 1: a down item, whose rows would land in `out`) or the next request's."""
    from expertstream.kernels import mailbox

    layout = ExpertLayout.for_dims(1024, 256)  # 16 down items, 16 up items an expert: the worker takes some
    blocks, ws2 = random_blocks(layout, 8, seed=5)
    rows = torch.stack(blocks)
    addr = (torch.arange(8, dtype=torch.long) * rows.stride(0) + rows.data_ptr()).view(1, 8)
    packed, out = torch.zeros(2 * cpu_moe.NMAX + 1024), torch.empty(1024)
    box, seq = mailbox.new_box(pin=False), torch.zeros(1, dtype=torch.int32)
    server = cpu_moe.SplitServer(addr, ws2.view(1, 8, 3), packed, out, box, layout, threads=2, idle_s=1.0)
    lib, g, stall = cpu_moe.library(), torch.Generator().manual_seed(kind), 1.0
    part = torch.zeros(1, 1024)

    def answer() -> torch.Tensor:  # a random request; the server's answer, checked and timed
        ids, w = torch.randperm(8, generator=g)[:6], torch.rand(6, generator=g)
        x = torch.randn(1024, generator=g)
        server.arm(2)
        seq.add_(1)
        t0 = time.perf_counter()
        mailbox.post(torch.cat((ids.float(), w, x)), packed, seq, box, 0, 6)
        got = mailbox.take(part, out, seq, box)
        assert time.perf_counter() - t0 < stall / 2
        want = cpu_moe.moe([blocks[i] for i in ids], ws2[ids], w[:, None], x[None], layout, 1)
        assert torch.equal(got, want)
        return got

    try:
        answer()
        lib.pool_stall(int(stall * 1e9), kind)
        t_end = time.perf_counter() + 5
        while time.perf_counter() < t_end and lib.pool_stall(0, kind):  # until a worker has taken the stall
            lib.pool_stall(int(stall * 1e9), kind)  # (not yet taken: set again)
            last = answer()
        assert not lib.pool_stall(0, kind), "no worker took an item"
        last = answer()
        time.sleep(stall + 0.2)  # the parked thread has woken and finished its item
        assert torch.equal(out.view(1, -1), last)
        answer()
    finally:
        lib.pool_stall(0, kind)
        server.close()


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("limit", [None, 0.3])
def test_mxfp4_blocks_and_the_swiglu_limit_match_the_twin(t, limit):
    """DeepSeek-V4's experts: MXFP4 blocks (a UE8M0 scale per 32 weights: 3 groups a row, an odd count) and
    gate and up clamped at the limit; the limit clamps some of these rows (the twin changes without it)."""
    layout = ExpertLayout.for_format("mxfp4", 96, 64)
    blocks, ws2 = random_blocks(layout, 5, seed=t)
    g = torch.Generator().manual_seed(300 + t)
    x = torch.randn(t, 96, generator=g)
    wt = torch.rand(5, t, generator=g) * (torch.rand(5, t, generator=g) < 0.6)
    ws2 = ws2 * 7  # not read: MXFP4 has no global scale
    got = cpu_moe.moe(blocks, ws2, wt, x, layout, 3, swiglu_limit=limit)
    want = cpu_moe.moe_twin(blocks, ws2, wt, x, layout, swiglu_limit=limit)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    if limit is not None:
        assert not torch.allclose(want, cpu_moe.moe_twin(blocks, ws2, wt, x, layout), rtol=1e-3, atol=1e-3)
    alone = torch.cat(
        [cpu_moe.moe(blocks, ws2, wt[:, i : i + 1], x[i : i + 1], layout, 2, limit) for i in range(t)]
    )
    assert torch.equal(got, alone)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_kernel_reads_every_code_and_the_nibble_order(fmt):
    # a one-hot input picks single columns: any swap of the two nibbles of a byte changes the result
    layout = ExpertLayout.for_format(fmt, 32, 32)
    blocks, ws2 = random_blocks(layout, 2, seed=7)
    wt = torch.ones(2, 8)
    for cols in (range(0, 8), range(8, 16), range(16, 24), range(24, 32)):
        x = torch.zeros(8, 32)
        x[torch.arange(8), torch.tensor(list(cols))] = 1.0
        torch.testing.assert_close(
            cpu_moe.moe(blocks, ws2, wt, x, layout), cpu_moe.moe_twin(blocks, ws2, wt, x, layout)
        )


def test_kernel_refuses_what_it_cannot_take():
    layout = ExpertLayout.for_dims(32, 16)
    blocks, ws2 = random_blocks(layout, 1, seed=0)
    with pytest.raises(ValueError, match="tokens"):
        cpu_moe.moe(blocks, ws2, torch.ones(1, 9), torch.zeros(9, 32), layout)
    with pytest.raises(ValueError, match="uint8"):
        cpu_moe.moe([blocks[0][:100]], ws2, torch.ones(1, 1), torch.zeros(1, 32), layout)


def test_read_rate_is_positive():
    assert cpu_moe.read_rate(1 << 22, threads=2, repeats=1) > 0


def test_the_layer_rate_is_timed_once_the_calls_are_warm(monkeypatch):
    # a fake kernel on a fake clock: calls take 4 ms for the first 10 ms (a cold pool), then 1 ms
    layout, k, clock, seen = ExpertLayout.for_dims(64, 32), 3, [0.0], []

    def moe(blocks, ws2, wt, x, layout, threads):
        seen.append([b.data_ptr() for b in blocks])
        clock[0] += 4e-3 if clock[0] < 10e-3 else 1e-3

    monkeypatch.setattr(cpu_moe, "moe", moe)
    monkeypatch.setattr(cpu_moe.time, "perf_counter", lambda: clock[0])
    rows = torch.zeros(7, layout.block_bytes, dtype=torch.uint8)
    rate = cpu_moe.layer_rate(rows, layout, k, threads=2, rounds=4, warm=0.01)
    assert rate == pytest.approx(k * layout.payload_bytes / 1e-3 / 1e9)
    assert len(seen) == 3 + 4  # calls starting before 10 ms are not timed
    # each call on the next k rows, wrapping around the 7
    ptr = [rows[i].data_ptr() for i in range(7)]
    assert seen[:3] == [[ptr[i % 7] for i in range(c * k, c * k + k)] for c in range(3)]


def test_the_cpu_bank_decodes_through_the_kernel_as_its_twin_does(tiny_workdir, monkeypatch):
    from test_engine import engine_for, prompt

    calls = []
    kernel = cpu_moe.moe
    monkeypatch.setattr(cpu_moe, "moe", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    eng = engine_for(tiny_workdir)
    try:
        ids = prompt(eng)[: cpu_moe.TMAX + 5].tolist()
        rows = {}
        for use in (True, False):
            eng.bank.kernel = use
            st = eng.new_state()
            eng.forward(st, ids[: cpu_moe.TMAX + 1])  # a prompt longer than TMAX keeps the torch form
            rows[use] = torch.stack([eng.forward(st, [t]) for t in ids[cpu_moe.TMAX + 1 :]])
        assert len(calls) == 4 * eng.args.num_hidden_layers  # 4 decode tokens, the kernel on every layer
        torch.testing.assert_close(
            rows[True], rows[False], rtol=0, atol=1e-5 * rows[False].abs().max().item()
        )
    finally:
        eng.close()


def test_a_first_call_on_many_threads_returns():
    # a worker made for a call must take that call's job (it once waited for the next one, forever)
    import subprocess
    import sys

    code = "from expertstream.kernels import cpu_moe; print(cpu_moe.read_rate(1 << 22, threads=8, repeats=1))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and float(r.stdout) > 0


def test_bench_cpu_times_a_full_shape_layer(monkeypatch):
    from expertstream.bench import cli, cpu

    assert cli.MODES["cpu"] == "expertstream.bench.cpu"
    monkeypatch.setattr(cpu, "SPREAD", 1)  # one layer's blocks: CI has no GB to spare
    ms, gbps = cpu.kernel_rate(threads=2, tokens=1, rounds=1)
    assert ms > 0 and gbps > 0


@pytest.mark.parametrize("t", [2, 3, 4, 8])
def test_a_tokens_sum_does_not_depend_on_the_tokens_beside_it(t):
    # batched decode runs several sequences' tokens in one call; each must get the bits it gets alone (the
    # T = 1, 2, 4 copies and the generic loop must not fuse multiply-adds differently)
    layout = ExpertLayout.for_dims(96, 48)
    blocks, ws2 = random_blocks(layout, 5, seed=20 + t)
    g = torch.Generator().manual_seed(200 + t)
    x = torch.randn(t, 96, generator=g)
    wt = torch.rand(5, t, generator=g) * (torch.rand(5, t, generator=g) < 0.6)
    together = cpu_moe.moe(blocks, ws2, wt, x, layout, 2)
    alone = torch.cat([cpu_moe.moe(blocks, ws2, wt[:, i : i + 1], x[i : i + 1], layout, 2) for i in range(t)])
    assert torch.equal(together, alone)


def test_bench_cpu_reads_and_runs_the_kernel_in_interleaved_rounds():
    from expertstream.bench import cpu

    r = cpu.interleaved(cpu.Layers(1), threads=2, rounds=2, read_bytes=1 << 22)
    assert len(r["read_gbps"]) == 2 and len(r["layer_4_of_read"]) == 2
    # each round's fraction is that round's kernel rate over that round's read rate
    for got, kernel, read in zip(r["layer_1_of_read"], r["layer_1_gbps"], r["read_gbps"]):
        assert got == pytest.approx(kernel / read)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a box without a GPU")
def test_bench_cpu_with_copy_is_refused_without_a_gpu():
    import argparse

    from expertstream.bench import cpu

    with pytest.raises(
        SystemExit, match="--with-copy needs a CUDA GPU to stream pinned RAM to; none is visible"
    ):
        cpu.run(argparse.Namespace(with_copy=True, threads=0, tokens=0, out=None, json=False))
