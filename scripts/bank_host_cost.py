"""Host cost of the GPU expert bank's one-token call, measured on the CPU device with the expert kernel
stubbed: slot bookkeeping, the cache policy, the expert -> slot map and (with `spec`) speculation. Default:
every expert already sits in a slot (the bench's `vram` regime); `--ram`: only the plan's minimum of 3 x K
slots, every block in the RAM cache (the `ram` regime: the bank soon holds them all and reads nothing back);
`--quarter`: the same slots, a RAM cache of a quarter of the blocks, misses read from disk (the `disk`
regime; the time then includes the reads). What it leaves out on a GPU: the CUDA calls (copies, events,
kernel launches), the id read-back's wait, and the router product, which is asynchronous there.

    python scripts/bank_host_cost.py WORKDIR [spec|nospec] [--ram | --quarter] [--profile]
"""

import cProfile
import pstats
import sys
import time

import torch

import expertstream.experts.gpu_bank as ge
from expertstream.experts.gpu_bank import GpuExperts
from expertstream.store import ExpertStore
from expertstream.workdir.workdir import Workdir


def main(workdir: str, mode: str = "spec", profile: bool = False, ram: bool = False, quarter: bool = False):
    torch.set_num_threads(1)
    wd = Workdir(workdir)
    ge.nvfp4_moe.nvfp4_moe_decode = lambda x, *a, **k: torch.zeros_like(x)  # bookkeeping only
    k, h, n_layers, n_experts = (
        wd.text_config["num_experts_per_tok"], wd.layout.hidden_size, wd.num_layers, wd.num_experts
    )  # fmt: skip
    blocks = n_layers * n_experts // 4 if quarter else n_layers * n_experts
    store = ExpertStore(wd, blocks * wd.layout.block_bytes + 1, io_threads=4)
    ram = ram or quarter
    bank = GpuExperts(wd, store, 3 * k if ram else n_layers * n_experts, "cpu", speculate=mode == "spec")
    g = torch.Generator().manual_seed(0)
    routers = {layer: torch.randn(n_experts, h, generator=g) for layer in range(n_layers)}
    bank.set_router_weights(routers)
    for layer in range(n_layers if not quarter else 0):  # every block into a slot (--ram: into RAM) first
        for i in range(0, n_experts, 16):
            if ram:
                for handle in store.request([(layer, e) for e in range(i, min(i + 16, n_experts))]):
                    handle.wait()
                    handle.release()
            else:
                bank.cache.fetch(layer, list(range(i, min(i + 16, n_experts))))
    xs = [[torch.randn(1, h, generator=g) for _ in range(n_layers)] for _ in range(300)]
    ids = [[torch.topk(x @ routers[layer].T, k).indices for layer, x in enumerate(row)] for row in xs]
    w = torch.full((1, k), 1.0 / k)

    def run(tokens: int) -> None:
        for t in range(tokens):
            for layer in range(n_layers):
                bank(layer, xs[t][layer], ids[t][layer], w)

    run(20)
    c0, t0 = bank.cache.stats.copies, time.perf_counter()
    run(300)
    per_call = (time.perf_counter() - t0) / (300 * n_layers) * 1e6
    copies = (bank.cache.stats.copies - c0) / (300 * n_layers)
    label = f"{mode} {'quarter' if quarter else 'ram' if ram else 'vram'}"
    c = bank.cache.stats
    print(f"{label}: {per_call:.0f} us per layer call, {copies:.1f} block copies per call, "
          f"{c.wait_seconds / max(1, c.requests) * 1e6 * k:.0f} us of it waiting for blocks, "
          f"resident {bank.resident}, {bank.host_syncs} syncs")  # fmt: skip
    if profile:
        prof = cProfile.Profile()
        prof.runcall(run, 100)
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    bank.close()
    store.close()


if __name__ == "__main__":
    modes = [a for a in sys.argv[2:] if not a.startswith("--")]
    main(
        sys.argv[1], modes[0] if modes else "spec", profile="--profile" in sys.argv, ram="--ram" in sys.argv,
        quarter="--quarter" in sys.argv,
    )  # fmt: skip
