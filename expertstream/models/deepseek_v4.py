"""DeepSeek-V4-Flash, the network only, in plain torch: a prompt, then decode steps on its `State`.

Per layer: manifold-constrained hyper-connections (hc streams, Sinkhorn-projected residual mixing) around
an attention block (MQA over one shared K=V head with partial interleaved RoPE, per-head sinks, a sliding
window, plus compressed KV entries: CSA layers compress every 4 tokens with overlapping windows and keep the
lightning indexer's top-k entries per query, HCA layers compress every 128 tokens and see them all) and a MoE
block (hash routing via `tid2eid[token]` in the first layers, sqrt-softplus top-k with a bias after; a shared
expert). The attention output goes through the grouped output projection. The routed sum comes from the
expert bank: `bank(layer, x [T, H], expert_ids [T, K], weights [T, K] fp32) -> [T, H]`, as for qwen4_exp.
Weights come from `load_weights` (checkpoint names, FP8 UE8M0 blocks dequantized; docs/deepseek-v4.md), or
from `engine_model`, which on the kernel path keeps them FP8 (`resident_weights`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from expertstream.formats import mxfp4
from expertstream.formats.fp8 import quantize_fp8_rows
from expertstream.formats.snapshot import Snapshot as Checkpoint
from expertstream.log import get_logger
from expertstream.memory_plan import ELEM_BYTES
from expertstream.models.base import Linear, upload
from expertstream.models.state import Snapshot

log = get_logger(__name__)

MODEL_TYPE = "deepseek_v4"
KINDS = {0: "sliding", 4: "csa", 128: "hca"}  # compress_ratios value -> attention kind


@dataclass(slots=True)
class DeepseekV4Args:
    """The config.json of a deepseek_v4 checkpoint; key names are the config's own."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    compress_ratios: list[int]
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    scoring_func: str = "sqrtsoftplus"
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = None
    eos_token_id: int | list[int] = 1
    max_position_embeddings: int | None = None  # None: no limit the engine enforces

    @classmethod
    def from_dict(cls, d: dict) -> DeepseekV4Args:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [
            f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in d
        ]
        if missing:
            raise ValueError(f"the deepseek_v4 config lacks {missing}")
        args = cls(**{k: v for k, v in d.items() if k in names})
        bad = sorted({r for r in args.compress_ratios[: args.num_hidden_layers] if r not in KINDS})
        if bad or args.scoring_func != "sqrtsoftplus":
            raise ValueError(
                f"unsupported deepseek_v4 config: compress ratios {bad} (known {sorted(KINDS)}), "
                f"scoring_func {args.scoring_func!r} (known 'sqrtsoftplus')"
            )
        return args

    @property
    def kinds(self) -> list[str]:
        return [KINDS[r] for r in self.compress_ratios[: self.num_hidden_layers]]


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [..., in] @ w.T: w a dense weight [out, in], or a `Linear` (FP8 blocks through the kernel)."""
    return w(x) if isinstance(w, Linear) else F.linear(x, w)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in FP32; V4's weight multiplies (it is not 1 + w). w None: the unweighted one."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (y if w is None else y * w.float()).to(x.dtype)


def inv_freq(a: DeepseekV4Args, compressed: bool) -> torch.Tensor:
    """[rope_dim / 2] frequencies: plain RoPE for sliding layers, YaRN (no mscale) for compressed ones."""
    dim = a.qk_rope_head_dim
    base = a.compress_rope_theta if compressed else a.rope_theta
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ys = a.rope_scaling or {}
    if not compressed or ys.get("type", ys.get("rope_type")) != "yarn":
        return 1.0 / pos
    factor, orig = ys["factor"], ys["original_max_position_embeddings"]

    def corr(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(ys.get("beta_fast", 32))), 0)
    high = min(math.ceil(corr(ys.get("beta_slow", 1))), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extra = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    return (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra


def rope(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the trailing rope slice of x [T, heads, D] (pairs 2i, 2i+1), positions pos [T]."""
    ang = pos.float()[:, None] * freq.to(pos.device)  # [T, rd/2]
    cos = ang.cos().repeat_interleave(2, -1)[:, None]
    sin = ang.sin().repeat_interleave(2, -1)[:, None]
    sin = -sin if inverse else sin
    rd = cos.shape[-1]
    nope, r = x[..., :-rd], x[..., -rd:].float()
    rot = torch.stack((-r[..., 1::2], r[..., 0::2]), -1).flatten(-2)
    return torch.cat([nope, (r * cos + rot * sin).to(x.dtype)], -1)


@dataclass
class CompressorState:
    """A compressor across calls: the projections of the open window's tokens, CSA's previous window's
    first half (kv and gate [ratio, width]), and every entry emitted so far [n, width]."""

    kv: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    prev: tuple[torch.Tensor, torch.Tensor] | None = None
    entries: torch.Tensor | None = None


class Compressor(nn.Module):
    """One compressed KV entry per `ratio` tokens: a softmax-gated sum (with a learned position bias) of the
    window's projections, RMS-normed and roped at the window's first position. CSA (overlap) mixes the
    previous window's first half into each entry over 2 * ratio slots."""

    def __init__(self, w: dict, p: str, width: int, ratio: int, eps: float):
        super().__init__()
        self.width, self.ratio, self.eps, self.overlap = width, ratio, eps, ratio == 4
        self.kv, self.gate = w[f"{p}.wkv.weight"], w[f"{p}.wgate.weight"]
        self.ape, self.norm = w[f"{p}.ape"], w[f"{p}.norm.weight"]

    def forward(self, x: torch.Tensor, freq: torch.Tensor, st: CompressorState) -> torch.Tensor:
        """x [T, H] the new tokens -> every entry so far [n, width] (st updated)."""
        m, d = self.ratio, self.width
        kv, gate = linear(x, self.kv), linear(x, self.gate)
        if st.kv is not None:
            kv, gate = torch.cat([st.kv, kv]), torch.cat([st.gate, gate])
        n = kv.shape[0] // m
        st.kv, st.gate = kv[n * m :], gate[n * m :]
        if st.entries is None:
            st.entries = kv.new_zeros(0, d)
        if n == 0:
            return st.entries
        kv, gate = kv[: n * m].view(n, m, -1), gate[: n * m].view(n, m, -1) + self.ape
        if self.overlap:
            # slots [0, m): the previous window's first half (none before window 0), [m, 2m): this one's 2nd
            pk, pg = st.prev or (kv.new_zeros(m, d), gate.new_full((m, d), float("-inf")))
            st.prev = (kv[-1, :, :d], gate[-1, :, :d])
            prev_kv = torch.cat([pk[None], kv[:-1, :, :d]])
            prev_gate = torch.cat([pg[None], gate[:-1, :, :d]])
            kv, gate = torch.cat([prev_kv, kv[..., d:]], 1), torch.cat([prev_gate, gate[..., d:]], 1)
        mixed = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(1)
        first = st.entries.shape[0]
        idx = first + torch.arange(n, device=x.device)
        new = rope(rms_norm(mixed, self.norm, self.eps)[:, None], idx * m, freq)[:, 0]
        st.entries = torch.cat([st.entries, new])
        return st.entries


@dataclass
class LayerState:
    """One attention layer across calls: the sliding window's last keys and their positions, the
    compressors' states."""

    kv: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    comp: CompressorState = dataclasses.field(default_factory=CompressorState)
    index: CompressorState = dataclasses.field(default_factory=CompressorState)


@dataclass
class State:
    """A sequence across calls (prefill, then decode token by token), with the engine's state interface:
    `pos`, `tokens`, `check_room`, `reset`, `snapshot` and `restore` (as models/state.State)."""

    layers: list[LayerState]
    length: int = 0
    max_model_len: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def new(cls, args: DeepseekV4Args, max_model_len: int | None = None) -> State:
        return cls([LayerState() for _ in range(args.num_hidden_layers)], max_model_len=max_model_len)

    @property
    def pos(self) -> int:
        return self.length

    def check_room(self, n: int) -> None:
        if self.max_model_len is not None and self.length + n > self.max_model_len:
            raise ValueError(
                f"{self.length} tokens in context + {n} new exceed max_model_len {self.max_model_len}; "
                "start a new conversation or raise --max-model-len"
            )

    def reset(self) -> None:
        self.layers = [LayerState() for _ in self.layers]
        self.length, self.tokens = 0, []

    def _flat(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, ls in enumerate(self.layers):
            for name, val in (("kv", ls.kv), ("pos", ls.pos)):
                if val is not None:
                    out[f"{i}.{name}"] = val
            for comp in ("comp", "index"):
                cs = getattr(ls, comp)
                for f in ("kv", "gate", "entries"):
                    if getattr(cs, f) is not None:
                        out[f"{i}.{comp}.{f}"] = getattr(cs, f)
                if cs.prev is not None:
                    out[f"{i}.{comp}.prev.kv"], out[f"{i}.{comp}.prev.gate"] = cs.prev
        return out

    def snapshot(self) -> Snapshot:
        tensors = {k: v.to("cpu", copy=True) for k, v in self._flat().items()}
        return Snapshot(tensors, self.length, list(self.tokens))

    def restore(self, snap: Snapshot) -> None:
        """Return to the snapshot's point; continuing from here reproduces what followed the snapshot."""
        device = next((t.device for t in self._flat().values()), None)
        t = {k: v.to(device) if device is not None else v.clone() for k, v in snap.tensors.items()}
        self.reset()
        for i, ls in enumerate(self.layers):
            ls.kv, ls.pos = t.get(f"{i}.kv"), t.get(f"{i}.pos")
            for comp in ("comp", "index"):
                cs = getattr(ls, comp)
                cs.kv, cs.gate, cs.entries = (t.get(f"{i}.{comp}.{f}") for f in ("kv", "gate", "entries"))
                if f"{i}.{comp}.prev.kv" in t:
                    cs.prev = (t[f"{i}.{comp}.prev.kv"], t[f"{i}.{comp}.prev.gate"])
        self.length, self.tokens = snap.pos, list(snap.tokens)


class Attention(nn.Module):
    def __init__(self, w: dict, p: str, a: DeepseekV4Args, kind: str):
        super().__init__()
        self.a, self.kind = a, kind
        g = {k: w[f"{p}.{k}.weight"] for k in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b")}
        self.w, self.sinks = g, w[f"{p}.attn_sink"]
        # the grouped output projection: group i's rows [i r, (i + 1) r) of wo_a take its heads' outputs
        r = a.o_lora_rank
        wo_a = g["wo_a"]
        self.wo_a = (
            [wo_a.rows(i * r, (i + 1) * r) for i in range(a.o_groups)] if isinstance(wo_a, Linear) else wo_a
        )
        ratio = {"csa": 4, "hca": 128}.get(kind)
        self.compressor = (
            Compressor(w, f"{p}.compressor", a.head_dim, ratio, a.rms_norm_eps) if ratio else None
        )
        if kind == "csa":
            self.index = Compressor(w, f"{p}.indexer.compressor", a.index_head_dim, 4, a.rms_norm_eps)
            self.index_q = w[f"{p}.indexer.wq_b.weight"]
            self.index_w = w[f"{p}.indexer.weights_proj.weight"]
        self.freq = inv_freq(a, compressed=kind != "sliding")

    def selected(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, st: LayerState) -> torch.Tensor:
        """The lightning indexer: [T, n] bool, the top-k compressed entries each query may see."""
        a = self.a
        keys = self.index(x, self.freq, st.index)  # [n, c]
        q = rope(linear(qr, self.index_q).view(len(pos), a.index_n_heads, -1), pos, self.freq)
        s = F.relu(torch.einsum("thc,nc->thn", q.float(), keys.float())) * a.index_head_dim**-0.5
        wts = linear(x, self.index_w).float() * a.index_n_heads**-0.5  # [T, heads]
        score = (s * wts[..., None]).sum(1)  # [T, n]
        ready = torch.arange(keys.shape[0], device=pos.device)[None] < ((pos + 1) // 4)[:, None]
        top = score.masked_fill(~ready, float("-inf")).topk(min(a.index_topk, keys.shape[0]), -1).indices
        return torch.zeros_like(ready).scatter_(1, top, True) & ready

    def forward(self, x: torch.Tensor, pos: torch.Tensor, st: LayerState) -> torch.Tensor:
        """x [T, H] at positions pos [T] (contiguous, after the st.pos already seen) -> [T, H]."""
        a, w, t = self.a, self.w, x.shape[0]
        qr = rms_norm(linear(x, w["wq_a"]), w["q_norm"], a.rms_norm_eps)
        q = rms_norm(linear(qr, w["wq_b"]).view(t, a.num_attention_heads, a.head_dim), None, a.rms_norm_eps)
        q = rope(q, pos, self.freq)
        kv = rope(rms_norm(linear(x, w["wkv"]), w["kv_norm"], a.rms_norm_eps)[:, None], pos, self.freq)[:, 0]
        kpos = pos
        if st.kv is not None:
            kv, kpos = torch.cat([st.kv, kv]), torch.cat([st.pos, pos])
        st.kv, st.pos = kv[-a.sliding_window :], kpos[-a.sliding_window :]
        dist = pos[:, None] - kpos[None]
        mask = (dist >= 0) & (dist < a.sliding_window)  # [T, keys] the local window
        if self.compressor is not None:
            entries = self.compressor(x, self.freq, st.comp)
            if self.kind == "csa":
                seen = self.selected(x, qr, pos, st)
            else:
                n = entries.shape[0]
                seen = (
                    torch.arange(n, device=pos.device)[None] < ((pos + 1) // self.compressor.ratio)[:, None]
                )
            kv, mask = torch.cat([kv, entries]), torch.cat([mask, seen], 1)
        logits = torch.einsum("thd,sd->hts", q, kv) * a.head_dim**-0.5
        logits = logits.masked_fill(~mask, float("-inf"))
        sink = self.sinks.to(logits.dtype)[:, None, None].expand(-1, t, 1)
        full = torch.cat([logits, sink], -1)
        probs = (full - full.amax(-1, keepdim=True)).softmax(-1)[..., :-1]
        out = rope(torch.einsum("hts,sd->thd", probs.to(kv.dtype), kv), pos, self.freq, inverse=True)
        # grouped output projection: each group of heads to o_lora_rank, then one matrix to hidden
        groups = out.reshape(t, a.o_groups, -1)
        if isinstance(self.wo_a, list):  # FP8: one matmul a group
            low = torch.cat([lin(groups[:, i]) for i, lin in enumerate(self.wo_a)], -1)
        else:
            wa = self.wo_a.view(a.o_groups, a.o_lora_rank, -1)
            low = torch.einsum("tgi,gri->tgr", groups, wa).flatten(1)
        return linear(low, w["wo_b"])


class HyperConnection(nn.Module):
    """mHC: from the hc streams [T, hc, H], the collapse weights (pre), the expansion weights (post) and the
    hc x hc residual mixing (comb, Sinkhorn-projected towards doubly stochastic)."""

    def __init__(self, w: dict, p: str, a: DeepseekV4Args):
        super().__init__()
        self.fn, self.base, self.scale = w[f"{p}_fn"], w[f"{p}_base"], w[f"{p}_scale"]
        self.hc, self.iters, self.eps, self.norm_eps = (
            a.hc_mult,
            a.hc_sinkhorn_iters,
            a.hc_eps,
            a.rms_norm_eps,
        )

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hc, eps = self.hc, self.eps
        flat = rms_norm(streams.flatten(1).float(), None, self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn.float()).split([hc, hc, hc * hc], -1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * self.scale[2] + comb_b.view(hc, hc), -1) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        collapsed = (pre[..., None] * streams).sum(1).to(streams.dtype)
        return post, comb, collapsed


class Moe(nn.Module):
    """Router (hash: `tid2eid[token]` picks, the scores weigh; top-k: sqrt-softplus scores plus a bias pick)
    and the shared expert; the routed sum comes from the bank."""

    def __init__(self, w: dict, p: str, a: DeepseekV4Args, layer: int, bank):
        super().__init__()
        self.a, self.layer, self.bank = a, layer, bank
        self.gate = w[f"{p}.gate.weight"]
        self.tid2eid = w.get(f"{p}.gate.tid2eid")
        self.bias = w.get(f"{p}.gate.bias")
        self.shared = [w[f"{p}.shared_experts.{k}.weight"] for k in ("w1", "w3", "w2")]

    def route(self, u: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(linear(u, self.gate)).sqrt()
        if self.tid2eid is not None:
            top = self.tid2eid[ids].long()
        else:
            top = torch.topk(scores + self.bias, self.a.num_experts_per_tok, -1, sorted=False).indices
        wts = scores.gather(1, top)
        return top, (wts / (wts.sum(-1, keepdim=True) + 1e-20) * self.a.routed_scaling_factor).float()

    def forward(self, u: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        top, wts = self.route(u, ids)
        lim = self.a.swiglu_limit
        g, up, down = self.shared
        shared = linear(F.silu(linear(u, g).clamp(max=lim)) * linear(u, up).clamp(-lim, lim), down)
        return self.bank(self.layer, u, top, wts).to(u.dtype) + shared


class DeepseekV4Model(nn.Module):
    """Whole-prompt forward: ids [T] -> logits [T, V]. Weights: checkpoint names, dense (see load_weights)."""

    def __init__(self, args: DeepseekV4Args, weights: dict[str, torch.Tensor], bank):
        super().__init__()
        self.a, self.w = args, weights
        self.attn, self.attn_hc, self.ffn_hc, self.moe = [], [], [], []
        for i, kind in enumerate(args.kinds):
            p = f"layers.{i}"
            self.attn.append(Attention(weights, f"{p}.attn", args, kind))
            self.attn_hc.append(HyperConnection(weights, f"{p}.hc_attn", args))
            self.ffn_hc.append(HyperConnection(weights, f"{p}.hc_ffn", args))
            self.moe.append(Moe(weights, f"{p}.ffn", args, i, bank))

    @staticmethod
    def mix(streams, post, comb, y) -> torch.Tensor:
        # the block output spread over the streams plus the Sinkhorn-mixed residual streams [T, hc, H]
        return post.to(y.dtype)[..., None] * y[:, None] + comb.to(y.dtype).transpose(-1, -2) @ streams

    def forward(self, ids: torch.Tensor, st: State | None = None, piece: int | None = None) -> torch.Tensor:
        """ids [T] -> final hidden [T, H] (before the head: `logits`); with `st`, the tokens continue that
        sequence (and st is updated). `piece`: run the prompt that many tokens at a time (same result)."""
        st = st or State.new(self.a)
        if piece and ids.shape[0] > piece:
            return torch.cat([self.forward(ids[i : i + piece], st) for i in range(0, ids.shape[0], piece)])
        a, w, eps = self.a, self.w, self.a.rms_norm_eps
        st.tokens.extend(ids.tolist())
        embed, dev = w["embed.weight"], w["norm.weight"].device
        # the embedding may stay in host RAM (engine_model): its rows are gathered there
        x = upload(embed[ids.to(embed.device)], dev, w["norm.weight"].dtype)
        ids = ids.to(dev)
        pos = st.length + torch.arange(ids.shape[0], device=ids.device)
        st.length += ids.shape[0]
        streams = x[:, None].expand(-1, a.hc_mult, -1).contiguous()
        for i in range(a.num_hidden_layers):
            p = f"layers.{i}"
            post, comb, c = self.attn_hc[i](streams)
            streams = self.mix(
                streams,
                post,
                comb,
                self.attn[i](rms_norm(c, w[f"{p}.attn_norm.weight"], eps), pos, st.layers[i]),
            )
            post, comb, c = self.ffn_hc[i](streams)
            streams = self.mix(
                streams, post, comb, self.moe[i](rms_norm(c, w[f"{p}.ffn_norm.weight"], eps), ids)
            )
        flat = rms_norm(streams.flatten(1).float(), None, eps)
        pre = torch.sigmoid(F.linear(flat, w["hc_head_fn"].float()) * w["hc_head_scale"] + w["hc_head_base"])
        return ((pre + a.hc_eps)[..., None] * streams).sum(1).to(streams.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden [T, H] -> FP32 logits [T, V]."""
        return linear(rms_norm(h, self.w["norm.weight"], self.a.rms_norm_eps), self.w["head.weight"]).float()


def _is_expert(name: str) -> bool:
    return ".ffn.experts." in name


def dequantized(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (FP8 weights with their `.scale`) -> every weight dense in `dtype`, FP8 blocks
    dequantized, scales dropped (integer tables stay integers)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".scale"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = mxfp4.dequantize_fp8_blocks_e8m0(t, tensors[name.removesuffix(".weight") + ".scale"])
        out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


def dense_surplus(inventory: dict[str, tuple[tuple[int, ...], str]], act_bytes: int, embed: str) -> int:
    """Bytes `engine_model` with kernels holds on the device beyond the stored weights other than `embed`
    (what a memory plan counts): FP8 matrices and their UE8M0 scales stay as stored and `embed` in host RAM,
    so only the float tensors held in the activation dtype differ (F32 ones under BF16: less than stored,
    a negative sum). inventory: resident name -> (shape, safetensors dtype)."""
    return sum(
        math.prod(shape) * (act_bytes - ELEM_BYTES[dtype])
        for name, (shape, dtype) in inventory.items()
        if name != embed and dtype in ("BF16", "F16", "F32")
    )


def resident_weights(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype, device, block: tuple[int, int], fp8_rows=()
) -> dict[str, torch.Tensor | Linear]:
    """Checkpoint tensors as the kernel path holds them: each FP8 matrix stays FP8 on `device` (a `Linear`
    through the block-scaled kernel, one UE8M0 scale per `block` as stored), the BF16 matrices named in
    `fp8_rows` (what the memory plan moves) become FP8 row-scaled, `embed.weight` stays in host RAM (one row
    a token is gathered there) and every other float tensor goes to `device` in `dtype`."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".scale"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[name.removesuffix(".weight") + ".scale"]
            out[name] = Linear(t.to(device), scale.to(device), kernel=True, block=block)
        elif name in fp8_rows:
            q, scale = quantize_fp8_rows(t)
            out[name] = Linear(q.to(device), scale.to(device), kernel=True)
        elif name == "embed.weight":
            out[name] = t.to(dtype)
        else:
            out[name] = t.to(device, dtype) if t.is_floating_point() else t.to(device)
    return out


def engine_model(
    workdir, args: DeepseekV4Args, bank, dtype: torch.dtype, device, kernels: bool = False, fp8_rows=()
) -> DeepseekV4Model:
    """The model over a working directory's resident weights and `bank`: with `kernels`, FP8 as shipped
    (`resident_weights`), else every weight dense in `dtype` on `device`; the routers go to the bank for its
    next-layer guesses."""
    if kernels:
        quant = workdir.config.get("quantization_config") or {}
        block = tuple(quant.get("weight_block_size", (mxfp4.FP8_BLOCK, mxfp4.FP8_BLOCK)))
        weights = resident_weights(workdir.load_resident(), dtype, device, block, fp8_rows)
        fp8 = [w.weight for w in weights.values() if isinstance(w, Linear)]
        log.info(
            "%d FP8 matrices (%.2f GiB) through the FP8 kernels",
            len(fp8),
            sum(w.numel() for w in fp8) / 2**30,
        )
    else:
        weights = dequantized(workdir.load_resident(device=device), dtype)  # decoded where the model runs
    bank.set_router_weights(
        {i: weights[f"layers.{i}.ffn.gate.weight"] for i in range(args.num_hidden_layers)}
    )
    return DeepseekV4Model(args, weights, bank)


def load_weights(snap: Checkpoint, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every non-expert tensor of the checkpoint under its name, dense (see `dequantized`); MTP is skipped."""
    names = [n for n in snap.tensors if not _is_expert(n) and not n.startswith("mtp.")]
    return dequantized({n: snap.read(n) for n in names}, dtype)


def dense_experts(snap: Checkpoint, args: DeepseekV4Args, dtype: torch.dtype = torch.float32):
    """Per layer gate_up [E, 2I, H] (w1 then w3) and down [E, H, I], dequantized (MXFP4 or BF16 twin)."""

    def read(name: str) -> torch.Tensor:
        t = snap.read(f"{name}.weight")
        if snap.info(f"{name}.weight").dtype == "I8":
            t = mxfp4.dequantize(t, snap.read(f"{name}.scale"))
        return t.to(dtype)

    gate_up, down = [], []
    for layer in range(args.num_hidden_layers):
        x = [f"layers.{layer}.ffn.experts.{e}" for e in range(args.n_routed_experts)]
        gate_up.append(torch.stack([torch.cat([read(f"{p}.w1"), read(f"{p}.w3")]) for p in x]))
        down.append(torch.stack([read(f"{p}.w2") for p in x]))
    return gate_up, down
