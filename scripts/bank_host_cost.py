"""Host cost of the GPU expert bank's one-token call when every expert already sits in a slot (the bench's
`vram` regime), measured on the CPU device with the expert kernel stubbed: slot bookkeeping, the cache
policy, the expert -> slot map and (with `spec`) speculation. What it leaves out on a GPU: kernel launches,
the id read-back's wait, and the router product, which is asynchronous there.

    python scripts/bank_host_cost.py WORKDIR [spec|nospec] [--profile]
"""

import cProfile
import pstats
import sys
import time

import torch

import expertstream.runtime.gpu_experts as ge
from expertstream.runtime.gpu_experts import GpuExperts
from expertstream.store import ExpertStore
from expertstream.workdir import Workdir


def main(workdir: str, mode: str = "spec", profile: bool = False) -> None:
    torch.set_num_threads(1)
    wd = Workdir(workdir)
    ge.nvfp4_moe.nvfp4_moe_decode = lambda x, *a, **k: torch.zeros_like(x)  # bookkeeping only
    k, h, n_layers, n_experts = (
        wd.text_config["num_experts_per_tok"], wd.layout.hidden_size, wd.num_layers, wd.num_experts
    )  # fmt: skip
    store = ExpertStore(wd, n_layers * n_experts * wd.layout.block_bytes + 1, io_threads=4)
    bank = GpuExperts(wd, store, n_layers * n_experts, "cpu", speculate=mode == "spec")
    g = torch.Generator().manual_seed(0)
    routers = {layer: torch.randn(n_experts, h, generator=g) for layer in range(n_layers)}
    bank.set_router_weights(routers)
    for layer in range(n_layers):  # every block into a slot first: the timed calls are all hits
        for i in range(0, n_experts, 16):
            bank.cache.fetch(layer, list(range(i, min(i + 16, n_experts))))
    xs = [[torch.randn(1, h, generator=g) for _ in range(n_layers)] for _ in range(300)]
    ids = [[torch.topk(x @ routers[layer].T, k).indices for layer, x in enumerate(row)] for row in xs]
    w = torch.full((1, k), 1.0 / k)

    def run(tokens: int) -> None:
        for t in range(tokens):
            for layer in range(n_layers):
                bank(layer, xs[t][layer], ids[t][layer], w)

    run(20)
    t0 = time.perf_counter()
    run(300)
    print(f"{mode}: {(time.perf_counter() - t0) / (300 * n_layers) * 1e6:.0f} us per layer call")
    if profile:
        prof = cProfile.Profile()
        prof.runcall(run, 100)
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    bank.close()
    store.close()


if __name__ == "__main__":
    modes = [a for a in sys.argv[2:] if not a.startswith("--")]
    main(sys.argv[1], modes[0] if modes else "spec", profile="--profile" in sys.argv)
