"""The qwen4_exp text network (Qwen3.8-Flash-Next), re-implemented from transformers' modeling_qwen4_exp.py.

Only the network lives here. Per-step metadata travels explicitly: every forward takes the conversation's
`State` (expertstream/models/state.py), which holds positions, KV, indexer keys, GDN/conv states and PLE
context; the model writes into it and advances it. Routed experts go through
`bank(layer, x, expert_ids, weights)` and PLE rows through `ple_table.read(rows)` / `ple_table.decode(raw)`,
so the model never knows where either lives.

Shapes: T new tokens, S = tokens in context after them, H hidden, N = hc_count streams, E experts, K top-k.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from expertstream.kernels.hyper import inject
from expertstream.models.attention import index_mask, kv_bucket
from expertstream.models.base import (
    ACT,
    ModelArgs,
    RMSNorm,
    Rope,
    apply_rope,
    moe_combine,
    rope_cos_sin,
    rope_inv_freq,
    route_topk,
    upload,
)
from expertstream.models.gated_delta import GatedDeltaNet, conv_step
from expertstream.models.hyper_connections import GatedResidual
from expertstream.models.stages import Stage, run_stages
from expertstream.models.state import State
from expertstream.models.weights import Weights
from expertstream.store.ple import ngram_row_ids, ngram_rows_one

# query heads x queries x keys of one prompt attention call: bounds its [Q, S] selection masks and scores
ATTN_PIECE_ELEMS = 1 << 26


class Attention(nn.Module):
    """QSA: gated GQA softmax attention whose keys are limited by the block indexer."""

    def __init__(self, w: Weights, p: str, a: ModelArgs, layer: int):
        super().__init__()
        self.layer, self.nh, self.nkv, self.d = (
            layer,
            a.num_attention_heads,
            a.num_key_value_heads,
            a.head_dim,
        )
        h, eps = a.hidden_size, a.rms_norm_eps
        if a.indexer_kv_heads != 1:
            raise ValueError(f"QSA needs indexer_kv_heads = 1, config has {a.indexer_kv_heads}")
        self.inh, self.di, self.c = a.indexer_n_heads, a.indexer_head_dim, a.indexer_compress_ratio
        self.block_topk = a.indexer_budget // self.c
        # q (with its gate), k, v and the indexer's q and raw key all read x: one matmul
        qkv = [f"{p}.{n}_proj.weight" for n in "qkv"]
        self.proj = w.fused(
            [
                (qkv[0], 2 * self.nh * self.d),
                (qkv[1], self.nkv * self.d),
                (qkv[2], self.nkv * self.d),
                (f"{p}.indexer.index_qk_proj.weight", (self.inh + 1) * self.di),
            ],
            h,
            biased=qkv if a.attention_bias else (),
        )
        self.o_proj = w.linear(f"{p}.o_proj.weight", h, self.nh * self.d, bias=a.attention_bias)
        self.q_norm = RMSNorm(w.get(f"{p}.q_norm.weight", (self.d,)), eps, kernel=w.kernels)
        self.k_norm = RMSNorm(w.get(f"{p}.k_norm.weight", (self.d,)), eps, kernel=w.kernels)
        self.iq_norm = RMSNorm(w.get(f"{p}.indexer.q_layernorm.weight", (self.di,)), eps, kernel=w.kernels)
        self.ik_norm = RMSNorm(w.get(f"{p}.indexer.k_layernorm.weight", (self.di,)), eps, kernel=w.kernels)

    def block_keys(self, raw: torch.Tensor, start: int, inv_freq: torch.Tensor) -> torch.Tensor:
        """Raw keys [n*c, Di] of whole blocks from position `start` -> [n, Di]: mean (FP32), norm, RoPE."""
        n = raw.shape[0] // self.c
        pooled = raw.view(n, self.c, self.di).float().mean(1).to(raw.dtype)
        starts = torch.arange(start, start + n * self.c, self.c, device=raw.device)
        cos, sin = rope_cos_sin(inv_freq, starts, raw.dtype)
        return apply_rope(self.ik_norm(pooled)[:, None], cos, sin)[:, 0]

    def forward(self, x: torch.Tensor, st: State, rope: Rope) -> torch.Tensor:
        t, p0 = x.shape[0], st.pos
        s = p0 + t
        if t == 1:
            return self.decode_one(x, st, rope, kv_bucket(s, st.k[self.layer].shape[0]))
        cos, sin, inv_freq = rope.cos, rope.sin, rope.inv_freq
        qg, k, v, qik = self.proj(x)
        q, gate = qg.view(t, self.nh, 2 * self.d).chunk(2, dim=-1)
        q = apply_rope(self.q_norm(q), cos, sin)
        kc, vc, rawc, bkc = st.k[self.layer], st.v[self.layer], st.idx_k[self.layer], st.blk_k[self.layer]
        kc[p0:s] = apply_rope(self.k_norm(k.view(t, self.nkv, self.d)), cos, sin)
        vc[p0:s] = v.view(t, self.nkv, self.d)
        qi, rk = qik.split((self.inh * self.di, self.di), dim=-1)
        rawc[p0:s] = rk
        qi = apply_rope(self.iq_norm(qi.reshape(t, self.inh, self.di)), cos, sin)
        # block keys never change once their block is complete: compute only blocks completed by this call
        b0, nb = p0 // self.c, s // self.c
        if nb > b0:
            bkc[b0:nb] = self.block_keys(rawc[b0 * self.c : nb * self.c], b0 * self.c, inv_freq)
        keys, vals = self.grouped(kc[:s]), self.grouped(vc[:s])  # [nkv, rep, S, D] views
        out = self.attend(q, qi, keys, vals, bkc[:nb], p0, s)
        out = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)

    # One token in three stages, the first and last with shapes fixed by the KV window `kv_len` alone
    # (CUDA-graph safe); the middle one, the block selection, follows transformers exactly: a top-k over
    # exactly the visible blocks (its tie order on the ReLU's exact zeros depends on that length).
    def decode_one(self, x: torch.Tensor, st: State, rope: Rope, kv_len: int) -> torch.Tensor:
        q, qi, gate = self.decode_in(x, st, rope)
        return self.decode_out(q, gate, self.decode_mask(qi, st, kv_len), st, kv_len)

    def decode_stages(self, st: State, kv_len: int) -> list[Stage]:
        """`decode_one` as stages (models/stages.py): reads u [1, H] and rope, writes y [1, H]."""
        return [
            Stage(lambda u, rope: self.decode_in(u, st, rope), ("u", "rope"), ("q", "qi", "gate")),
            Stage(lambda qi: self.decode_mask(qi, st, kv_len), ("qi",), ("mask",), graphable=False),
            Stage(
                lambda q, gate, mask: self.decode_out(q, gate, mask, st, kv_len),
                ("q", "gate", "mask"),
                ("y",),
            ),
        ]

    def decode_in(self, x: torch.Tensor, st: State, rope: Rope) -> tuple[torch.Tensor, ...]:
        """x [1, H] at the device position rope.positions [1] -> q [1, nh, D], indexer q [1, Hi, Di], gate;
        KV, the raw indexer key and the key of the block holding the position are written in place."""
        pos = rope.positions
        qg, k, v, qik = self.proj(x)
        q, gate = qg.view(1, self.nh, 2 * self.d).chunk(2, dim=-1)
        q = apply_rope(self.q_norm(q), rope.cos, rope.sin)
        kc, vc, rawc, bkc = st.k[self.layer], st.v[self.layer], st.idx_k[self.layer], st.blk_k[self.layer]
        kc.index_copy_(0, pos, apply_rope(self.k_norm(k.view(1, self.nkv, self.d)), rope.cos, rope.sin))
        vc.index_copy_(0, pos, v.view(1, self.nkv, self.d))
        qi, rk = qik.split((self.inh * self.di, self.di), dim=-1)
        rawc.index_copy_(0, pos, rk)
        qi = apply_rope(self.iq_norm(qi.reshape(1, self.inh, self.di)), rope.cos, rope.sin)
        # the block's key from its raw keys so far (State pads rawc to whole blocks): the value block_keys
        # gives once the block is complete, and nothing reads it before (an incomplete block is not visible)
        blk = torch.div(pos, self.c, rounding_mode="floor")  # [1]
        raw = rawc.view(-1, self.c, self.di).index_select(0, blk)  # [1, c, Di]
        pooled = raw.float().mean(1).to(raw.dtype)
        bcos, bsin = rope_cos_sin(rope.inv_freq, blk * self.c, raw.dtype)
        bkc.index_copy_(0, blk, apply_rope(self.ik_norm(pooled)[:, None], bcos, bsin)[:, 0])
        return q, qi, gate

    def decode_mask(self, qi: torch.Tensor, st: State, kv_len: int) -> torch.Tensor:
        """Keys the query at st.pos may attend, [1, kv_len] bool: causal, and beyond the budget only the top
        blocks among the visible ones plus the incomplete tail. Shapes follow the host's position."""
        s = st.pos + 1
        keep = torch.zeros(kv_len, dtype=torch.bool, device=qi.device)
        keep[:s] = True
        nvis = s // self.c  # complete visible blocks
        if nvis > self.block_topk:
            bk = st.blk_k[self.layer][:nvis]
            scores = torch.relu(qi[0].float() @ bk.float().T).sum(0) / math.sqrt(self.di)  # [nvis]
            blocks = keep[: nvis * self.c].view(nvis, self.c)
            blocks.fill_(False).index_fill_(0, scores.topk(self.block_topk).indices, True)
        return keep[None]

    def decode_out(self, q, gate, mask, st: State, kv_len: int) -> torch.Tensor:
        """q [1, nh, D] attends over kc[:kv_len] under mask [1, kv_len]; output gate and o_proj -> [1, H]."""
        keys, vals = self.grouped(st.k[self.layer][:kv_len]), self.grouped(st.v[self.layer][:kv_len])
        qg = q.reshape(self.nkv, self.nh // self.nkv, 1, self.d)
        o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask[None, None], scale=self.d**-0.5)
        return self.o_proj(o.reshape(1, -1) * torch.sigmoid(gate.reshape(1, -1)))

    def grouped(self, kv: torch.Tensor) -> torch.Tensor:
        """A layer's keys or values [S, nkv, D] as [nkv, rep, S, D] views, each kv head seen by its rep query
        heads: GQA in the fused attention kernel, which reads them in place (a 3-D call falls back to the math
        kernel, which copies K and V to FP32 and materialises the scores: 0.2 GiB a token at 32k)."""
        return kv.transpose(0, 1)[:, None].expand(-1, self.nh // self.nkv, -1, -1)

    def attend(self, q, qi, keys, vals, bk, p0: int, s: int) -> torch.Tensor:
        """Queries at positions p0..s-1, in pieces that bound the score memory. -> [T, nh, D]."""
        t, rep = q.shape[0], self.nh // self.nkv
        qpos = torch.arange(p0, s, device=q.device)
        out = torch.empty(t, self.nh, self.d, dtype=q.dtype, device=q.device)
        piece = max(1, ATTN_PIECE_ELEMS // (s * self.nh))
        for i in range(0, t, piece):
            j = min(t, i + piece)
            mask = index_mask(qi[i:j], qpos[i:j], bk, s, self.c, self.block_topk)  # [Q, S]
            # query head h = kv * rep + r: [nkv, rep, Q, D] against the grouped keys, one mask for every head
            qg = q[i:j].view(j - i, self.nkv, rep, self.d).permute(1, 2, 0, 3)
            o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask[None, None], scale=self.d**-0.5)
            out[i:j] = o.permute(2, 0, 1, 3).reshape(j - i, self.nh, self.d)
        return out


class PLELayer(nn.Module):
    """Per-layer n-gram embedding injected into every stream: gated by the streams, plus a dilated conv."""

    def __init__(self, w: Weights, p: str, a: ModelArgs, layer: int, table):
        super().__init__()
        self.layer, self.table, self.n, self.h = layer, table, a.hc_count, a.hidden_size
        nh, e, eps = self.n * self.h, a.ple_embed_dim, a.rms_norm_eps
        heads = (a.ngram_size - 1) * a.heads_per_ngram
        self.eos, self.heads_per_ngram = a.eos_id, a.heads_per_ngram
        self.mult = w.host(f"{p}.ple_embedding.layer_multipliers", (a.ngram_size,))
        self.vocab = w.host(f"{p}.ple_embedding.ngram_heads_vocab_sizes", (heads,))
        self.offsets = w.host(f"{p}.ple_embedding.ngram_heads_offsets", (heads,))
        # the same as plain ints, for one token's hash (`ngram_rows_one`)
        self._hash_lists = (
            self.mult.tolist(), self.vocab.tolist(), self.offsets.tolist(), self.heads_per_ngram
        )  # fmt: skip
        self.proj = w.fused([(f"{p}.key_proj.weight", nh), (f"{p}.value_proj.weight", self.h)], e)
        self.norm_key = RMSNorm(w.get(f"{p}.norm_key.weight", (nh,)), eps, self.h, w.kernels)
        self.norm_query = RMSNorm(w.get(f"{p}.norm_query.weight", (nh,)), eps, self.h, w.kernels)
        self.norm_conv = RMSNorm(w.get(f"{p}.norm_conv.weight", (nh,)), eps, self.h, w.kernels)
        self.conv_w = nn.Buffer(w.get(f"{p}.conv1d.weight", (nh, 1, a.ple_conv_kernel_size)))
        self.conv_wt = nn.Buffer(self.conv_w[:, 0].T.float().contiguous())  # [K, N*H] for one token
        self.dilation = a.ngram_size

    def raw(self, ids: torch.Tensor, st: State, device: torch.device) -> torch.Tensor:
        """ids [T] on the host -> the table's raw rows [T, heads * width] on `device`: hashed and read on the
        host (one token in plain ints), uploaded as stored (FP8 bytes: a quarter of the values' bytes)."""
        raw = self.raw_host(ids, st)
        return upload(raw, device, raw.dtype)

    def raw_host(self, ids: torch.Tensor, st: State) -> torch.Tensor:
        """`raw` before its upload: the raw rows [T, heads * width] on the host."""
        if ids.shape[0] == 1:
            rows = ngram_rows_one(st.ple_ctx.tolist(), int(ids[0]), self.eos, *self._hash_lists)
            return self.table.read(rows)
        return self.table.read(self._rows(ids, st))

    def read_ahead(self, ids: torch.Tensor | None, st: State) -> None:
        """Let the table start reading the rows of a call's ids [T] (host), which its pieces read later;
        None when the call is done."""
        self.table.read_ahead(None if ids is None else self._rows(ids, st))

    def _rows(self, ids: torch.Tensor, st: State) -> torch.Tensor:
        a = (self.mult, self.vocab, self.offsets, self.heads_per_ngram)
        return ngram_row_ids(st.ple_ctx, ids, self.eos, *a)

    def from_raw(self, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Raw rows on the device -> [T, ple_embed_dim] in dtype (device work only: graphs hold it)."""
        return self.table.decode(raw).to(dtype)

    def embed(self, ids: torch.Tensor, st: State, like: torch.Tensor) -> torch.Tensor:
        """ids [T] on the host -> [T, ple_embed_dim] on like's device and dtype."""
        return self.from_raw(self.raw(ids, st, like.device), like.dtype)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, st: State) -> torch.Tensor:
        return self.mix(x, self.embed(ids, st, x), st)

    def mix(self, x: torch.Tensor, e: torch.Tensor, st: State) -> torch.Tensor:
        """x [T, N*H] streams, e [T, ple_embed_dim] -> the PLE term added to x; advances the conv history."""
        key, value = self.proj(e)
        key = self.norm_key(key).unflatten(-1, (self.n, self.h))
        query = self.norm_query(x).unflatten(-1, (self.n, self.h))
        gamma = (key * query).sum(-1, keepdim=True) / math.sqrt(self.h)  # [T, N, 1]
        gamma = gamma.abs().clamp_min(1e-6).sqrt() * gamma.sign()
        gated = (torch.sigmoid(gamma) * value[:, None, :]).flatten(-2)  # [T, N*H]
        normed = self.norm_conv(gated)
        conv = st.ple_conv[self.layer]
        hist = torch.cat((conv, normed))
        conv.copy_(hist[-conv.shape[0] :])
        if x.shape[0] == 1:
            out = conv_step(hist, self.conv_wt, self.dilation)
        else:
            out = F.conv1d(hist.T[None], self.conv_w, groups=hist.shape[1], dilation=self.dilation)[0].T
        return gated + F.silu(out)


class SparseMoe(nn.Module):
    """Router (FP32 softmax, top-k, renormalise) + shared expert; the routed sum comes from the bank."""

    def __init__(self, w: Weights, p: str, a: ModelArgs, layer: int, bank):
        super().__init__()
        self.layer, self.bank, self.k, self.norm_topk = layer, bank, a.num_experts_per_tok, a.norm_topk_prob
        h, si = a.hidden_size, a.shared_expert_intermediate_size
        # the router stays its own matrix: the bank may hold the same tensor (speculation)
        self.gate = w.linear(f"{p}.gate.weight", a.num_experts, h)
        self.shared_in = w.fused(
            [
                (f"{p}.shared_expert.gate_proj.weight", si),
                (f"{p}.shared_expert.up_proj.weight", si),
                (f"{p}.shared_expert_gate.weight", 1),
            ],
            h,
        )
        self.shared_down_proj = w.linear(f"{p}.shared_expert.down_proj.weight", h, si)
        self.act = ACT[a.hidden_act]
        self.kernel = w.kernels

    def route(self, u: torch.Tensor, shared: bool = True) -> tuple[torch.Tensor, ...]:
        """All but the routed sum: (top_i [T, K], top_w [T, K] FP32, shared gate [T, 1], shared [T, H]);
        without `shared` the first two only (layer-major spans run the shared expert after the routed)."""
        # logits [T, E] -> ids, weights [T, K]
        routing = route_topk(self.gate(u), self.k, self.norm_topk, kernel=self.kernel)
        return routing + self.shared(u) if shared else routing

    def routed_stages(self) -> list[Stage]:
        """One token's routed sum as stages: reads u [1, H], top_i, top_w, writes routed [1, H]; split at the
        bank's host work as its `decode_mode` says (experts/bank.py)."""
        bank, i, k, mode = self.bank, self.layer, self.k, self.bank.decode_mode
        if mode == "eager":  # all host work (the CPU bank)
            call = lambda u, ids, w: bank(i, u, ids, w)  # noqa: E731
            return [Stage(call, ("u", "top_i", "top_w"), ("routed",), graphable=False)]
        compute = ("u", "top_i", "top_w"), ("routed",)
        stage_next = Stage(  # the next layer's guesses to VRAM (side stream); then their disk reads
            lambda want: bank.decode_stage(i, want, k), ("want",), after=(bank.decode_launched,),
            join=bank.decode_join,
        )  # fmt: skip
        want = Stage(lambda u, ids: bank.decode_want(i, u, ids), ("u", "top_i"), ("want",))
        if mode == "split":  # a CPU share: its request posted, the GPU's share, the CPU's answer added (all
            # device work); with staging, the next layer's guesses go to VRAM over its dense work
            send = lambda u, ids, w: bank.split_send(i, u, ids, w)  # noqa: E731
            # one hook a layer (`_after` runs a hook that several stages share once a graph)
            launched = functools.partial(bank.split_launched, i)
            split = [
                Stage(send, compute[0], graphable=bank.graphed),
                Stage(lambda u: bank.split_gpu(i, u), ("u",), ("part",), after=(launched,)),
                Stage(lambda part: bank.split_take(i, part), ("part",), ("routed",), graphable=bank.graphed),
            ]
            if not bank.stage_guesses:
                return split
            # split_launched already calls decode_launched
            return [want, *split, dataclasses.replace(stage_next, after=())]
        if mode == "fixed":  # every block placed for good: device work alone, its reads counted on the host
            done = (bank.decode_launched, lambda: bank.decode_fixed_reads(k))
            return [Stage(lambda u, ids, w: bank.decode_compute(i, u, ids, w), *compute, after=done)]
        return [  # "staged": only the fetch and the location table stay host work
            want,
            Stage(lambda want: bank.decode_prepare(i, want, k), ("want",), graphable=False),
            Stage(lambda u, ids, w: bank.decode_compute(i, u, ids, w), *compute),
            stage_next,  # behind this kernel
        ]

    def shared(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared expert: (its gate [T, 1], its output [T, H])."""
        gate, up, shared_gate = self.shared_in(u)
        return torch.sigmoid(shared_gate), self.shared_down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, w: Weights, a: ModelArgs, i: int, bank, ple_table):
        super().__init__()
        p = f"layers.{i}"
        self.ple = PLELayer(w, f"{p}.ple", a, i, ple_table) if i in a.ple_layers else None
        self.attn_hc = GatedResidual(w, f"{p}.attn_hyper_connection", a)
        if a.layer_types[i] == "linear_attention":
            self.linear_attn, self.self_attn = GatedDeltaNet(w, f"{p}.linear_attn", a, i), None
        else:
            self.linear_attn, self.self_attn = None, Attention(w, f"{p}.self_attn", a, i)
        self.mlp_hc = GatedResidual(w, f"{p}.mlp_hyper_connection", a)
        self.mlp = SparseMoe(w, f"{p}.mlp", a, i, bank)
        self.kernel = w.kernels

    def decode_stages(self, st: State, kv_len: int) -> list[Stage]:
        """One token through the layer (models/stages.py): reads the streams x, rope and, with a PLE, the
        layer's raw PLE rows; writes x."""
        out, i, ple = [], self.mlp.layer, self.ple
        if ple is not None:
            # its raw rows came with the token's host inputs: decoding and mixing is device work
            mix = lambda x, raw: x + ple.mix(x, ple.from_raw(raw, x.dtype), st)  # noqa: E731
            out.append(Stage(mix, ("x", f"ple_raw{i}"), ("x",)))
        out.append(Stage(self.attn_hc, ("x",), ("u", "c")))
        if self.linear_attn is not None:  # recurrent state in place: device work
            out.append(Stage(lambda u: self.linear_attn(u, st), ("u",), ("y",)))
        else:
            out += self.self_attn.decode_stages(st, kv_len)
        moe = ("x", "u", "c", "top_i", "top_w", "shared_gate", "shared")
        out.append(Stage(self.moe_in, ("x", "y", "c"), moe))
        out += self.mlp.routed_stages()
        out.append(Stage(self.moe_out, ("x", "c", "routed", "shared_gate", "shared"), ("x",)))
        return out

    # The parts of `forward`, which the one-token stages above and the layer-major prompt run one by one.
    def attention(self, u: torch.Tensor, st: State, rope: Rope) -> torch.Tensor:
        if self.linear_attn is not None:
            return self.linear_attn(u, st)
        return self.self_attn(u, st, rope)

    def moe_in(self, x, y, c, shared: bool = True) -> tuple[torch.Tensor, ...]:
        """Attention output into the streams, then MoE input: (x, u, c, top_i, top_w, shared gate, shared),
        without the last two when not `shared`."""
        x = inject(x, y, c)
        u, c = self.mlp_hc(x)
        return (x, u, c, *self.mlp.route(u, shared))

    def moe_out(self, x, c, routed, shared_gate, shared, in_place: bool = False) -> torch.Tensor:
        # routed may be the bank's FP32 sums: cast here, piece by piece in layer-major spans
        return moe_combine(x, c, routed, shared_gate, shared, in_place, kernel=self.kernel)

    def pre_moe(self, x, ids, st: State, rope: Rope, shared: bool = True) -> tuple[torch.Tensor, ...]:
        """PLE, attention and router: (x, u, c, top_i, top_w, shared gate, shared), all per token (without the
        last two when not `shared`)."""
        if self.ple is not None:
            x = x + self.ple(x, ids, st)
        u, c = self.attn_hc(x)
        return self.moe_in(x, self.attention(u, st, rope), c, shared)

    def forward(self, x, ids, st: State, rope: Rope) -> torch.Tensor:
        x, u, c, top_i, top_w, shared_gate, shared = self.pre_moe(x, ids, st, rope)
        return self.moe_out(x, c, self.mlp.bank(self.mlp.layer, u, top_i, top_w), shared_gate, shared)


class Qwen4ExpModel(nn.Module):
    """The text network. `forward(ids, state)` -> final mixer output [T, H]; `logits(h)` -> [T, V] FP32.

    Args:
        args: the parsed text_config.
        tensors: HF text names (prefix `model.language_model.` removed) -> tensors; `embed_tokens.weight`
            stays on its own device (it may live in host RAM).
        bank: the expert bank, `bank(layer, x [T, H], expert_ids [T, K], weights [T, K] fp32) -> [T, H]`.
        ple_table: object with `read(rows [T, heads] | one token's list) -> raw rows on the host`,
            `read_ahead(rows [T, heads] | None)` (a hint: those rows are read soon; None: no longer) and
            `decode(raw on any device) -> [T, ple_embed_dim] float32`, or None without PLE layers.
        dtype, device: activation dtype and compute device.
        fp8_row_scaled: names stored as float8_e4m3fn with a `<name>_scale` FP32 row scale.
        kernels: run the Triton kernels where they can run (CUDA tensors, or the interpreter), else the
            torch twins.
    """

    def __init__(
        self,
        args: ModelArgs,
        tensors: dict,
        bank,
        ple_table=None,
        dtype=torch.float32,
        device="cpu",
        fp8_row_scaled=(),
        kernels: bool = False,
    ):
        super().__init__()
        if args.ple_layer_ids and ple_table is None:
            raise ValueError(f"config has PLE layers {args.ple_layer_ids} but no PLE table was given")
        self.args, self.dtype, self.device = args, dtype, torch.device(device)
        w = Weights(tensors, dtype, device, fp8_row_scaled, kernels)
        embed = tensors.get("embed_tokens.weight")
        if embed is None or tuple(embed.shape) != (args.vocab_size, args.hidden_size):
            raise ValueError(f"embed_tokens.weight missing or not [{args.vocab_size}, {args.hidden_size}]")
        self.embed = embed
        self.layers = nn.ModuleList(
            DecoderLayer(w, args, i, bank, ple_table) for i in range(args.num_hidden_layers)
        )
        self.mixer = GatedResidual(w, "hyper_connection_mixer", args, inject=False)
        self.lm_head = w.linear("lm_head.weight", args.vocab_size, args.hidden_size)
        self.inv_freq = rope_inv_freq(args).to(device)

    @property
    def banks(self) -> list:
        """The distinct expert banks of the layers (usually one), in layer order."""
        return list({id(layer.mlp.bank): layer.mlp.bank for layer in self.layers}.values())

    def decode_stages(self, st: State, kv_len: int, send=None) -> list[Stage]:
        """One token's forward on `st`, QSA over `kv_len` KV rows, as ordered stages (models/stages.py):
        reads the host id "ids" [1], writes the final mixer output "h" [1, H]. `send({name: host tensor})
        -> {name: device tensor}` sends the token's host inputs (default: each on its own)."""
        send = send or (lambda parts: {n: upload(v, self.device, v.dtype) for n, v in parts.items()})
        ple = [layer.ple for layer in self.layers if layer.ple is not None]
        inputs = ("row", "positions", *(f"ple_raw{p.layer}" for p in ple))

        def host_inputs(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # known from the ids and the state: the embedding row, the position, each PLE layer's raw rows
            parts = [self.table_rows(ids), torch.tensor([st.pos])] + [p.raw_host(ids, st) for p in ple]
            sent = send(dict(zip(inputs, parts)))
            return tuple(sent[n] for n in inputs)

        out = [
            Stage(host_inputs, ("ids",), inputs, graphable=False),
            Stage(
                lambda row, pos: (self.streams(row), self.rope_at(pos)), ("row", "positions"), ("x", "rope")
            ),
        ]
        for bank in self.banks:  # layer 0's guesses to VRAM over its attention (side stream)
            if bank.decode_mode == "staged" or (bank.decode_mode == "split" and bank.stage_guesses):
                out.append(Stage(bank.decode_stage_first, ("row",), join=bank.decode_join))
        for layer in self.layers:
            out += layer.decode_stages(st, kv_len)
        out.append(Stage(lambda x: self.mixer(x)[0], ("x",), ("h",)))
        return out

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Host ids [T] -> the N streams [T, N*H] on the device, each seeded with the token embedding."""
        return self.streams(self.token_rows(ids))

    def token_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Host ids [T] -> their embedding rows [T, H] on the device (gathered where the table lives)."""
        return upload(self.table_rows(ids), self.device, self.dtype)

    def table_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Host ids [T] -> their embedding rows [T, H] in the compute dtype, where the table lives."""
        return self.embed[ids.to(self.embed.device)].to(self.dtype)

    def streams(self, rows: torch.Tensor) -> torch.Tensor:
        """Embedding rows [T, H] on the device -> the N streams [T, N*H] (device work only)."""
        return rows.repeat(1, self.args.hc_count)

    def positions(self, st: State, t: int) -> torch.Tensor:
        """The next t positions [T] on the device (made there: no upload)."""
        return torch.arange(st.pos, st.pos + t, device=self.device)

    def rope(self, st: State, t: int) -> Rope:
        return self.rope_at(self.positions(st, t))

    def rope_at(self, positions: torch.Tensor) -> Rope:
        """RoPE rows of device positions [T] (device work only)."""
        return Rope(positions, *rope_cos_sin(self.inv_freq, positions, self.dtype), self.inv_freq)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, st: State, piece: int | None = None) -> torch.Tensor:
        """ids [T] -> final mixer output [T, H]. One token runs `decode_stages`. With `piece` < T the tokens
        run layer by layer: each layer's PLE, attention and router take `piece` tokens at a time
        (their state carries from piece to piece), then the layer's experts run once over all T tokens, so
        the bank fetches each block once per layer instead of once per piece."""
        t = ids.shape[0]
        st.check_room(t)
        # ids stay on the host (embedding rows, PLE hashing, the state's token list): nothing is read back
        ids = ids.cpu()
        if t == 1:
            stages = self.decode_stages(st, kv_bucket(st.pos + 1, st.max_model_len))
            h = run_stages(stages, {"ids": ids})["h"]
            st.advance(ids)
            return h
        ple = [layer.ple for layer in self.layers if layer.ple is not None]
        for p in ple:  # every piece's PLE rows are known now: their reads overlap the layers before
            p.read_ahead(ids, st)
        try:
            x = self.embed_rows(ids)
            if piece is None or t <= piece:
                rope = self.rope(st, t)
                for layer in self.layers:
                    x = layer(x, ids, st, rope)
            else:
                x = self._layer_major(x, ids, st, piece)
        finally:
            for p in ple:
                p.read_ahead(None, st)
        st.advance(ids)
        return self.mixer(x)[0]

    def _layer_major(self, x: torch.Tensor, ids: torch.Tensor, st: State, piece: int) -> torch.Tensor:
        t, pos0, ctx0 = ids.shape[0], st.pos, st.ple_ctx
        bounds = [(a, min(a + piece, t)) for a in range(0, t, piece)]
        # each piece sees the state as if the pieces before it had gone through every layer: its position
        # and the n-gram context of the tokens before it (KV and recurrent state are per layer already)
        before = torch.cat((ctx0, ids))
        views = []
        for a, b in bounds:
            st.pos = pos0 + a
            views.append((a, b, before[a : a + ctx0.shape[0]].clone(), self.rope(st, b - a)))
        # what a span holds across a layer is memory_plan's per-span-token bytes: its streams x [T, N*H] (made
        # by forward) are updated in place (a piece's PLE, attention and router read only its own rows), and
        # the shared expert and the injection run piece by piece after the routed experts (on the pieces'
        # rows, as the plain forward runs them before)
        try:
            for layer in self.layers:
                whole = None  # (u, c, top_i, top_w) for all t tokens
                for a, b, ctx, rope in views:
                    st.pos, st.ple_ctx = pos0 + a, ctx
                    x[a:b], *part = layer.pre_moe(x[a:b], ids[a:b], st, rope, shared=False)
                    if whole is None:
                        whole = [v.new_empty((t, *v.shape[1:])) for v in part]
                    for w, v in zip(whole, part):
                        w[a:b] = v
                u, c, top_i, top_w = whole
                routed = layer.mlp.bank(layer.mlp.layer, u, top_i, top_w)
                for a, b, _, _ in views:
                    layer.moe_out(x[a:b], c[a:b], routed[a:b], *layer.mlp.shared(u[a:b]), in_place=True)
        finally:
            st.pos, st.ple_ctx = pos0, ctx0
        return x

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()
