"""What the expert bank tests share: random routing for the tiny model."""

import torch


def routing(wd, t, seed):
    """x [t, H], expert_ids [t, K] (distinct per token) and weights [t, K] summing to 1, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    k = wd.text_config["num_experts_per_tok"]
    ids = torch.stack([torch.randperm(wd.num_experts, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    x = torch.randn(t, wd.layout.hidden_size, generator=g)
    return x, ids, w / w.sum(-1, keepdim=True)
