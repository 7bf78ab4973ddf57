"""The qwen4_exp text network (Qwen3.8-Flash-Next), re-implemented from transformers' modeling_qwen4_exp.py.

Only the network lives here. Per-step metadata travels explicitly: every forward takes the conversation's
`State` (expertstream/state.py), which holds positions, KV, indexer keys, GDN/conv states and PLE context; the
model writes into it and advances it. Routed experts go through `bank(layer, x, expert_ids, weights)` and PLE
rows through `ple_table.lookup(rows)`, so the model never knows where either lives.

Shapes: T new tokens, S = tokens in context after them, H hidden, N = hc_count streams, E experts, K top-k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from expertstream.models.base import Linear, ModelArgs, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from expertstream.ple import ngram_row_ids
from expertstream.state import State

ACT = {"silu": F.silu, "sigmoid": torch.sigmoid}
GDN_CHUNK = 64
# attention score elements materialised per query piece (FP32: 256 MiB), bounds long-prompt memory
ATTN_PIECE_ELEMS = 1 << 26


class Weights:
    """HF text names (prefix removed) -> tensors in the run dtype/device; FP8 row-scaled names stay FP8."""

    def __init__(self, tensors: dict, dtype: torch.dtype, device, fp8_row_scaled=()):
        self.tensors, self.dtype, self.device, self.fp8 = tensors, dtype, device, set(fp8_row_scaled)

    def get(
        self, name: str, shape: tuple | None = None, float_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"weight {name!r} is missing from the resident weights")
        t = self.tensors[name]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"weight {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        dtype = (float_dtype or self.dtype) if t.is_floating_point() else t.dtype
        return t.to(self.device, dtype)

    def linear(self, name: str, out_f: int, in_f: int) -> Linear:
        if name in self.fp8:
            if self.tensors[name].dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise ValueError(
                    f"{name!r} is listed as FP8 row-scaled but stored as {self.tensors[name].dtype}"
                )
            q = self.get(name, (out_f, in_f), torch.float8_e4m3fn)
            return Linear(q, self.get(f"{name}_scale", (out_f,), torch.float32))
        return Linear(self.get(name, (out_f, in_f)))


class GatedResidual(nn.Module):
    """Hyper-connection: N streams [T, N*H] -> block input u [T, H] and injection weights c [T, N]."""

    def __init__(self, w: Weights, p: str, a: ModelArgs, inject: bool = True):
        super().__init__()
        self.n, self.h = a.hc_count, a.hidden_size
        nh = self.n * self.h
        self.norm = RMSNorm(w.get(f"{p}.hc_norm.weight", (nh,)), a.rms_norm_eps, group=self.h)
        self.down = w.linear(f"{p}.input_mix_weight_down.weight", a.hc_lowrank, nh)
        self.up = w.linear(f"{p}.input_mix_weight_up.weight", nh, a.hc_lowrank)
        self.inject = w.linear(f"{p}.block_inject_weight.weight", self.n, nh) if inject else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        xn = self.norm(x)
        mix = torch.sigmoid(self.up(F.silu(self.down(xn) / self.n)))
        u = (mix.unflatten(-1, (self.n, self.h)) * xn.unflatten(-1, (self.n, self.h))).mean(-2)
        c = 2 * torch.sigmoid(self.inject(xn) / self.n) if self.inject is not None else None
        return u, c


def inject(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    # x [T, N*H] += c [T, N] (x) y [T, H], stream by stream
    return x + (y[:, None, :] * c[:, :, None]).flatten(-2)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_recurrent(q, k, v, g, beta, s):
    """One token, FP32: q, k [Hv, Dk], v [Hv, Dv], g, beta [Hv]; s [Hv, Dk, Dv] updated in place."""
    s.mul_(g.exp()[:, None, None])
    delta = (v - torch.einsum("hk,hkv->hv", k, s)) * beta[:, None]
    s.add_(k[:, :, None] * delta[:, None, :])
    return torch.einsum("hk,hkv->hv", q, s)


def gated_delta_chunked(q, k, v, g, beta, s, chunk: int = GDN_CHUNK):
    """Prompt form, FP32. q, k [Hv, T, Dk], v [Hv, T, Dv], g, beta [Hv, T]; s [Hv, Dk, Dv] updated in place.

    Per chunk the delta-rule updates are folded by a unit-lower-triangular solve (the UT transform), then one
    sequential scan over chunks carries the state. Padding tokens have k = v = beta = g = 0: no effect.
    """
    hv, t, dk = k.shape
    pad = (-t) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    nc = (t + pad) // chunk
    q, k, v = (x.view(hv, nc, chunk, -1) for x in (q, k, v))
    g, beta = g.view(hv, nc, chunk), beta.view(hv, nc, chunk)
    kb, vb = k * beta[..., None], v * beta[..., None]
    gc = g.cumsum(-1)  # [Hv, nc, C] log decay from chunk start
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(future, float("-inf")).exp()  # [Hv, nc, C, C]
    ut = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(ut, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, kb * gc.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * gc.exp()[..., None]
    k_dec = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [Hv, nc, 1, 1]
    out = torch.empty_like(v)
    for i in range(nc):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + attn[:, i] @ v_new
        s.mul_(chunk_decay[:, i]).add_(k_dec[:, i].transpose(-1, -2) @ v_new)
    return out.view(hv, nc * chunk, -1)[:, :t]


class GatedDeltaNet(nn.Module):
    def __init__(self, w: Weights, p: str, a: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.hk, self.hv = a.linear_num_key_heads, a.linear_num_value_heads
        self.dk, self.dv = a.linear_key_head_dim, a.linear_value_head_dim
        key_dim, val_dim = self.hk * self.dk, self.hv * self.dv
        self.splits = (key_dim, key_dim, val_dim)
        conv_dim = 2 * key_dim + val_dim
        self.in_proj_qkv = w.linear(f"{p}.in_proj_qkv.weight", conv_dim, a.hidden_size)
        self.in_proj_z = w.linear(f"{p}.in_proj_z.weight", val_dim, a.hidden_size)
        self.in_proj_b = w.linear(f"{p}.in_proj_b.weight", self.hv, a.hidden_size)
        self.in_proj_a = w.linear(f"{p}.in_proj_a.weight", self.hv, a.hidden_size)
        self.conv_w = nn.Buffer(w.get(f"{p}.conv1d.weight", (conv_dim, 1, a.linear_conv_kernel_dim)))
        self.dt_bias = nn.Buffer(w.get(f"{p}.dt_bias", (self.hv,)))
        self.A_log = nn.Buffer(w.get(f"{p}.A_log", (self.hv,)))
        self.norm_w = nn.Buffer(w.get(f"{p}.norm.weight", (self.dv,)))
        self.out_proj = w.linear(f"{p}.out_proj.weight", a.hidden_size, val_dim)
        self.act, self.gate_act, self.eps = ACT[a.hidden_act], ACT[a.output_gate_type], a.rms_norm_eps

    def forward(self, x: torch.Tensor, st: State) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.in_proj_qkv(x)  # [T, conv_dim]
        z = self.in_proj_z(x).view(t, self.hv, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x)).float()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        # depthwise causal conv over [last K-1 rows | new rows]
        hist = torch.cat((st.conv[self.layer], qkv))
        st.conv[self.layer].copy_(hist[-st.conv[self.layer].shape[0] :])
        qkv = self.act(F.conv1d(hist.T[None], self.conv_w, groups=hist.shape[1])[0].T)
        q, k, v = torch.split(qkv, self.splits, dim=-1)
        rep = self.hv // self.hk
        q = l2norm(q.float().view(t, self.hk, self.dk)).repeat_interleave(rep, 1) * self.dk**-0.5
        k = l2norm(k.float().view(t, self.hk, self.dk)).repeat_interleave(rep, 1)
        v = v.float().view(t, self.hv, self.dv)
        s = st.rec[self.layer]
        if t == 1:
            o = gated_delta_recurrent(q[0], k[0], v[0], g[0], beta[0], s)[None]
        else:
            o = gated_delta_chunked(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.T, beta.T, s)
            o = o.transpose(0, 1)
        # per-head plain RMSNorm (weight not zero-centred) times the output gate
        o = o.to(x.dtype).float()
        o = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        o = (self.norm_w * o) * self.gate_act(z.float())
        return self.out_proj(o.to(x.dtype).reshape(t, -1))


def index_mask(qi: torch.Tensor, qpos: torch.Tensor, bk: torch.Tensor, s: int, c: int, block_topk: int):
    """QSA key mask [Q, S] for indexer queries qi [Q, Hi, Di] at positions qpos [Q], block keys bk [S//c, Di].

    A query at p sees V = p + 1 tokens: its V // c complete blocks compete (top block_topk by the summed ReLU
    score), the V mod c tail tokens are always kept. Scores and masks are computed for all queries at once.
    """
    keys = torch.arange(s, device=qi.device)
    causal = keys[None, :] <= qpos[:, None]
    nvis = (qpos + 1) // c  # [Q] complete visible blocks
    nb = bk.shape[0]
    if nb == 0 or int(nvis.max()) <= block_topk:
        return causal  # every complete block fits the budget: plain causal attention
    scores = torch.relu(torch.einsum("qhd,bd->qhb", qi.float(), bk.float())).sum(1) / math.sqrt(qi.shape[-1])
    visible = torch.arange(nb, device=qi.device)[None, :] < nvis[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    # everything at or above the k-th best visible score; rows with nvis <= k get kth = -inf: all visible
    kth = scores.topk(min(block_topk, nb), dim=-1).values[:, -1:]
    chosen = (scores > kth) | ((scores == kth) & visible)  # [Q, nb]
    # a tie at the k-th score (ReLU makes zeros common) is broken as transformers does: topk over exactly the
    # visible row, batched per visible-block count (only such rows, usually none)
    tied = chosen.sum(-1) > block_topk
    for n in torch.unique(nvis[tied]).tolist():
        rows = tied & (nvis == n)
        top = scores[rows, :n].topk(block_topk, dim=-1).indices
        chosen[rows] = torch.zeros_like(chosen[rows]).scatter_(1, top, True)
    blk = keys // c
    in_blocks = blk[None, :] < nvis[:, None]
    chosen_tok = chosen.gather(1, blk.clamp_max(nb - 1)[None, :].expand(qi.shape[0], -1))
    return causal & (~in_blocks | chosen_tok)


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
        self.q_proj = w.linear(f"{p}.q_proj.weight", 2 * self.nh * self.d, h)
        self.k_proj = w.linear(f"{p}.k_proj.weight", self.nkv * self.d, h)
        self.v_proj = w.linear(f"{p}.v_proj.weight", self.nkv * self.d, h)
        self.o_proj = w.linear(f"{p}.o_proj.weight", h, self.nh * self.d)
        self.q_norm = RMSNorm(w.get(f"{p}.q_norm.weight", (self.d,)), eps)
        self.k_norm = RMSNorm(w.get(f"{p}.k_norm.weight", (self.d,)), eps)
        if a.indexer_kv_heads != 1:
            raise ValueError(f"QSA needs indexer_kv_heads = 1, config has {a.indexer_kv_heads}")
        self.inh, self.di, self.c = a.indexer_n_heads, a.indexer_head_dim, a.indexer_compress_ratio
        self.block_topk = a.indexer_budget // self.c
        self.index_qk_proj = w.linear(f"{p}.indexer.index_qk_proj.weight", (self.inh + 1) * self.di, h)
        self.iq_norm = RMSNorm(w.get(f"{p}.indexer.q_layernorm.weight", (self.di,)), eps)
        self.ik_norm = RMSNorm(w.get(f"{p}.indexer.k_layernorm.weight", (self.di,)), eps)

    def block_keys(self, raw: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """Raw keys [S, Di] -> complete blocks [S//c, Di]: mean (FP32), norm, RoPE at the block start."""
        nb = raw.shape[0] // self.c
        pooled = raw[: nb * self.c].view(nb, self.c, self.di).float().mean(1).to(raw.dtype)
        starts = torch.arange(nb, device=raw.device) * self.c
        cos, sin = rope_cos_sin(inv_freq, starts, raw.dtype)
        return apply_rope(self.ik_norm(pooled)[:, None], cos, sin)[:, 0]

    def forward(self, x: torch.Tensor, st: State, cos, sin, inv_freq) -> torch.Tensor:
        t, p0 = x.shape[0], st.pos
        s = p0 + t
        q, gate = self.q_proj(x).view(t, self.nh, 2 * self.d).chunk(2, dim=-1)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(t, self.nkv, self.d)), cos, sin)
        kc, vc, rawc = st.k[self.layer], st.v[self.layer], st.idx_k[self.layer]
        kc[p0:s] = k
        vc[p0:s] = self.v_proj(x).view(t, self.nkv, self.d)
        qi, rk = self.index_qk_proj(x).split((self.inh * self.di, self.di), dim=-1)
        rawc[p0:s] = rk
        qi = apply_rope(self.iq_norm(qi.reshape(t, self.inh, self.di)), cos, sin)
        bk = self.block_keys(rawc[:s], inv_freq)
        # GQA without copying KV: query head h = kv * rep + r, so group the rep heads of a kv head as rows
        rep = self.nh // self.nkv
        keys, vals = kc[:s].transpose(0, 1), vc[:s].transpose(0, 1)  # [nkv, S, D] views
        qpos = torch.arange(p0, s, device=x.device)
        out = torch.empty(t, self.nh, self.d, dtype=x.dtype, device=x.device)
        piece = max(1, ATTN_PIECE_ELEMS // (s * self.nh))
        for i in range(0, t, piece):
            j = min(t, i + piece)
            mask = index_mask(qi[i:j], qpos[i:j], bk, s, self.c, self.block_topk)  # [Q, S]
            qg = (
                q[i:j]
                .view(j - i, self.nkv, rep, self.d)
                .permute(1, 2, 0, 3)
                .reshape(self.nkv, rep * (j - i), -1)
            )
            mask = mask[None].expand(rep, -1, -1).reshape(1, rep * (j - i), s)
            o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, scale=self.d**-0.5)
            out[i:j] = (
                o.view(self.nkv, rep, j - i, self.d).permute(2, 0, 1, 3).reshape(j - i, self.nh, self.d)
            )
        out = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)


class PLELayer(nn.Module):
    """Per-layer n-gram embedding injected into every stream: gated by the streams, plus a dilated conv."""

    def __init__(self, w: Weights, p: str, a: ModelArgs, layer: int, table):
        super().__init__()
        self.layer, self.table, self.n, self.h = layer, table, a.hc_count, a.hidden_size
        nh, e, eps = self.n * self.h, a.ple_embed_dim, a.rms_norm_eps
        heads = (a.ngram_size - 1) * a.heads_per_ngram
        self.eos, self.heads_per_ngram = a.eos_id, a.heads_per_ngram
        self.mult = w.get(f"{p}.ple_embedding.layer_multipliers", (a.ngram_size,)).cpu()
        self.vocab = w.get(f"{p}.ple_embedding.ngram_heads_vocab_sizes", (heads,)).cpu()
        self.offsets = w.get(f"{p}.ple_embedding.ngram_heads_offsets", (heads,)).cpu()
        self.key_proj = w.linear(f"{p}.key_proj.weight", nh, e)
        self.value_proj = w.linear(f"{p}.value_proj.weight", self.h, e)
        self.norm_key = RMSNorm(w.get(f"{p}.norm_key.weight", (nh,)), eps, group=self.h)
        self.norm_query = RMSNorm(w.get(f"{p}.norm_query.weight", (nh,)), eps, group=self.h)
        self.norm_conv = RMSNorm(w.get(f"{p}.norm_conv.weight", (nh,)), eps, group=self.h)
        self.conv_w = nn.Buffer(w.get(f"{p}.conv1d.weight", (nh, 1, a.ple_conv_kernel_size)))
        self.dilation = a.ngram_size

    def forward(self, x: torch.Tensor, ids: torch.Tensor, st: State) -> torch.Tensor:
        rows = ngram_row_ids(
            st.ple_ctx, ids.cpu(), self.eos, self.mult, self.vocab, self.offsets, self.heads_per_ngram
        )
        e = self.table.lookup(rows).to(x.device, x.dtype)  # [T, ple_embed_dim]
        key = self.norm_key(self.key_proj(e)).unflatten(-1, (self.n, self.h))
        query = self.norm_query(x).unflatten(-1, (self.n, self.h))
        gamma = (key * query).sum(-1, keepdim=True) / math.sqrt(self.h)  # [T, N, 1]
        gamma = gamma.abs().clamp_min(1e-6).sqrt() * gamma.sign()
        gated = torch.sigmoid(gamma) * self.value_proj(e)[:, None, :]  # [T, N, H]
        normed = self.norm_conv(gated.flatten(-2))
        hist = torch.cat((st.ple_conv[self.layer], normed))
        st.ple_conv[self.layer].copy_(hist[-st.ple_conv[self.layer].shape[0] :])
        conv = F.conv1d(hist.T[None], self.conv_w, groups=hist.shape[1], dilation=self.dilation)[0].T
        return gated.flatten(-2) + F.silu(conv)


class SparseMoe(nn.Module):
    """Router (FP32 softmax, top-k, renormalise) + shared expert; the routed sum comes from the bank."""

    def __init__(self, w: Weights, p: str, a: ModelArgs, layer: int, bank):
        super().__init__()
        self.layer, self.bank, self.k, self.norm_topk = layer, bank, a.num_experts_per_tok, a.norm_topk_prob
        h, si = a.hidden_size, a.shared_expert_intermediate_size
        self.gate = w.linear(f"{p}.gate.weight", a.num_experts, h)
        self.shared_gate_proj = w.linear(f"{p}.shared_expert.gate_proj.weight", si, h)
        self.shared_up_proj = w.linear(f"{p}.shared_expert.up_proj.weight", si, h)
        self.shared_down_proj = w.linear(f"{p}.shared_expert.down_proj.weight", h, si)
        self.shared_expert_gate = w.linear(f"{p}.shared_expert_gate.weight", 1, h)
        self.act = ACT[a.hidden_act]

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        logits = self.gate(u)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.k, dim=-1)
        if self.norm_topk:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        # rounded through the activation dtype as transformers does, passed on as FP32
        routed = self.bank(self.layer, u, top_i, top_w.to(logits.dtype).float())
        shared = self.shared_down_proj(self.act(self.shared_gate_proj(u)) * self.shared_up_proj(u))
        return routed + torch.sigmoid(self.shared_expert_gate(u)) * shared


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

    def forward(self, x, ids, st: State, cos, sin, inv_freq) -> torch.Tensor:
        if self.ple is not None:
            x = x + self.ple(x, ids, st)
        u, c = self.attn_hc(x)
        y = (
            self.linear_attn(u, st)
            if self.linear_attn is not None
            else self.self_attn(u, st, cos, sin, inv_freq)
        )
        x = inject(x, y, c)
        u, c = self.mlp_hc(x)
        return inject(x, self.mlp(u), c)


class Qwen4ExpModel(nn.Module):
    """The text network. `forward(ids, state)` -> final mixer output [T, H]; `logits(h)` -> [T, V] FP32.

    Args:
        args: the parsed text_config.
        tensors: HF text names (prefix `model.language_model.` removed) -> tensors; `embed_tokens.weight`
            stays on its own device (it may live in host RAM).
        bank: the expert bank, `bank(layer, x [T, H], expert_ids [T, K], weights [T, K] fp32) -> [T, H]`.
        ple_table: object with `lookup(rows [T, heads]) -> [T, ple_embed_dim]`, or None without PLE layers.
        dtype, device: activation dtype and compute device.
        fp8_row_scaled: names stored as float8_e4m3fn with a `<name>_scale` FP32 row scale.
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
    ):
        super().__init__()
        if args.ple_layer_ids and ple_table is None:
            raise ValueError(f"config has PLE layers {args.ple_layer_ids} but no PLE table was given")
        self.args, self.dtype, self.device = args, dtype, torch.device(device)
        w = Weights(tensors, dtype, device, fp8_row_scaled)
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

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, st: State) -> torch.Tensor:
        t = ids.shape[0]
        st.check_room(t)
        ids = ids.to(self.device)
        x = self.embed[ids.to(self.embed.device)].to(self.device, self.dtype)
        x = x.repeat(1, self.args.hc_count)  # the embedding seeds all N streams [T, N*H]
        cos, sin = rope_cos_sin(
            self.inv_freq, torch.arange(st.pos, st.pos + t, device=self.device), self.dtype
        )
        for layer in self.layers:
            x = layer(x, ids, st, cos, sin, self.inv_freq)
        st.advance(ids)
        return self.mixer(x)[0]

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()
