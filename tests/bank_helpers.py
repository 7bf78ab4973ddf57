"""What the expert bank tests share: random routing for the tiny model, a store holding every block."""

import torch

from expertstream.store import ExpertStore


def routing(wd, t, seed):
    """x [t, H], expert_ids [t, K] (distinct per token) and weights [t, K] summing to 1, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    k = wd.text_config["num_experts_per_tok"]
    ids = torch.stack([torch.randperm(wd.num_experts, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    x = torch.randn(t, wd.layout.hidden_size, generator=g)
    return x, ids, w / w.sum(-1, keepdim=True)


def ram_store(wd, **store_kw):
    """A store whose RAM cache holds every block of `wd` (a bank on it adopts their rows: `resident` "ram");
    store_kw: the store's host allocation (`alloc`, ...)."""
    store = ExpertStore(wd, wd.num_layers * wd.num_experts * wd.layout.block_bytes, io_threads=2, **store_kw)
    for h in store.request([(layer, e) for layer in range(wd.num_layers) for e in range(wd.num_experts)]):
        h.wait()
        h.release()
    return store
