"""The CPU share of GPU decode (experts/split_bank.py): the GPU bank runs through the Triton interpreter on
the CPU, the CPU share through the C kernel, against the torch bank."""

import pytest
import torch

from expertstream.experts.cpu_bank import StreamedExperts
from expertstream.experts.gpu_bank import GpuExperts
from expertstream.experts.split_bank import SplitExperts, cpu_experts
from expertstream.kernels import cpu_moe
from expertstream.store import ExpertStore
from expertstream.workdir.workdir import Workdir

pytest.importorskip("triton")  # conftest runs it through the interpreter when there is no CUDA
needs_kernel = pytest.mark.skipif(cpu_moe.library() is None, reason="no C compiler to build the CPU kernel")


def test_the_share_balances_the_two_sides():
    assert cpu_experts(10, cpu_gbps=55.0, bus_gbps=55.0) == 5
    assert cpu_experts(10, cpu_gbps=20.0, bus_gbps=55.0) == 3  # 10 x 20 / 75 = 2.7
    assert cpu_experts(10, cpu_gbps=1.0, bus_gbps=55.0) == 0
    assert cpu_experts(10, cpu_gbps=0.0, bus_gbps=55.0) == 0
    assert cpu_experts(8, cpu_gbps=1e3, bus_gbps=1.0) == 8


def routing(wd, t, seed):
    g = torch.Generator().manual_seed(seed)
    k = wd.text_config["num_experts_per_tok"]
    ids = torch.stack([torch.randperm(wd.num_experts, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return torch.randn(t, wd.layout.hidden_size, generator=g), ids, w / w.sum(-1, keepdim=True)


@needs_kernel
def test_split_decode_equals_the_torch_bank(tiny_workdir, host_alloc, kernel_device):
    wd = Workdir(tiny_workdir)
    k = wd.text_config["num_experts_per_tok"]
    blocks = wd.num_layers * wd.num_experts
    with ExpertStore(wd, blocks * wd.layout.block_bytes, io_threads=2, **host_alloc) as store:
        ref = StreamedExperts(wd, store, torch.float32)
        gpu = GpuExperts(wd, store, 8, kernel_device)
        bank = SplitExperts(gpu, wd, share=0.5, threads=lambda: 2)
        assert bank.n_cpu == round(0.5 * k)
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
        assert bank.resident == "ram" and bank.splitting and bank.decode_mode == "eager"
        syncs = bank.host_syncs
        for layer in range(wd.num_layers):
            x, ids, w = routing(wd, 1, seed=10 + layer)
            got = bank(layer, *(v.to(kernel_device) for v in (x, ids, w))).cpu()
            want = ref(layer, x, ids, w)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
        assert bank.cpu_blocks == wd.num_layers * bank.n_cpu  # each layer's share ran on the CPU
        assert bank.host_syncs == syncs + wd.num_layers  # one read-back a layer
        assert bank.counters().resident_ram_reads == wd.num_layers * (k - bank.n_cpu)  # the bus's share
        # every expert on the CPU: the GPU kernel is not launched at all
        bank.n_cpu = k
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
