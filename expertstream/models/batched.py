"""Several sequences through the network in one layer-major pass, each on its own `State`.

`forward_many` is `Qwen4ExpModel.forward` for a batch of sequences: the dense work of every sequence runs on
its own rows and state, and the expert bank runs once per layer over all rows, so each block is fetched once
for the whole batch. Shapes: T_i new tokens of sequence i, H hidden, N*H streams.
"""

from __future__ import annotations

import torch

from expertstream.models.state import State


@torch.no_grad()
def forward_many(model, items: list[tuple[torch.Tensor, State]], piece: int) -> list[torch.Tensor]:
    """Several sequences in one layer-major pass: items [(ids [T_i], state_i)] -> final mixer outputs
    [[T_i, H]]. Each layer runs every sequence's pieces of `piece` tokens through its PLE, attention and
    router on that sequence's state, then the bank once over all rows (each expert block fetched once
    per layer for all of them). Dense work and the bank's per-sequence sums take the rows `forward` of
    one sequence gives them, so each sequence's output is the same as alone."""
    states = [st for _, st in items]
    for ids, st in items:
        st.check_room(ids.shape[0], keep=states)  # room in the KV pool, never at another's expense
    items = [(ids.cpu(), st) for ids, st in items]
    lens = [ids.shape[0] for ids, _ in items]
    offs = [sum(lens[:i]) for i in range(len(items))]
    segments = [(o, o + n) for o, n in zip(offs, lens)]
    saved = [(st.pos, st.ple_ctx) for _, st in items]
    ple = [(layer.ple, ids, st) for layer in model.layers if layer.ple is not None for ids, st in items]
    ple = [(p, ids, st) for p, ids, st in ple if ids.shape[0] > 1]
    for p, ids, st in ple:
        p.read_ahead(ids, st)
    # per sequence, its pieces as `_layer_major` cuts them: (global row range, ids, state, ctx, rope)
    views = []
    for (ids, st), o in zip(items, offs):
        t, pos0, ctx0 = ids.shape[0], st.pos, st.ple_ctx
        before = torch.cat((ctx0, ids))
        for a in range(0, t, piece):
            b = min(a + piece, t)
            st.pos = pos0 + a
            ctx = before[a : a + ctx0.shape[0]].clone()
            views.append((o + a, o + b, ids[a:b], st, pos0 + a, ctx, model.rope(st, b - a)))
        st.pos = pos0
    try:
        x = torch.cat([model.embed_rows(ids) for ids, _ in items])
        for layer in model.layers:
            whole = None  # (u, c, top_i, top_w) for every row
            for a, b, ids, st, pos, ctx, rope in views:
                st.pos, st.ple_ctx = pos, ctx
                x[a:b], *part = layer.pre_moe(x[a:b], ids, st, rope, shared=False)
                if whole is None:
                    whole = [v.new_empty((x.shape[0], *v.shape[1:])) for v in part]
                for w, v in zip(whole, part):
                    w[a:b] = v
            u, c, top_i, top_w = whole
            routed = _routed(layer.mlp, u, top_i, top_w, segments)
            for a, b, *_ in views:
                layer.moe_out(x[a:b], c[a:b], routed[a:b], *layer.mlp.shared(u[a:b]), in_place=True)
    finally:
        for (_, st), (pos, ctx) in zip(items, saved):
            st.pos, st.ple_ctx = pos, ctx
        for p, _, st in ple:
            p.read_ahead(None, st)
    out = []
    for (ids, st), (a, b) in zip(items, segments):
        st.advance(ids)
        out.append(model.mixer(x[a:b])[0])
    return out


def _routed(mlp, u, top_i, top_w, segments: list[tuple[int, int]]) -> torch.Tensor:
    """The routed sums of several sequences' rows: one bank call when the bank sums per segment
    (`segmented`: each block fetched once for all), else one call per sequence."""
    if len(segments) == 1:
        return mlp.bank(mlp.layer, u, top_i, top_w)
    if mlp.bank.segmented:
        return mlp.bank(mlp.layer, u, top_i, top_w, segments=segments)
    return torch.cat([mlp.bank(mlp.layer, u[a:b], top_i[a:b], top_w[a:b]) for a, b in segments])
