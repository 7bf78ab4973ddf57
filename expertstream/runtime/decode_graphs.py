"""One decode token as CUDA graphs: the static-shape stretches between the points that must stay eager.

Eager points of a one-token step: the token's host inputs, in one stage: its embedding row, its position and
every PLE layer's rows (hashed and read on the host, uploaded as stored); the streams, RoPE rows, PLE decoding
and PLE maths made from them are captured. Then each QSA layer's block selection (transformers' top-k runs
over exactly the visible blocks, a length that follows the position) and the expert bank's host work (it reads
the routing ids back to fetch experts; a "staged" bank (experts/bank.py) keeps only that eager, its kernels
read the slots through fixed addresses and are captured; a "fixed" bank, whose blocks all have a fixed
place, has no host work left and no eager point: its programs are captured anew once it is).
Everything between two of them keeps its shapes and addresses from token to token, so it is captured once and
replayed: whole GDN layers, QSA projections, KV writes and attention over a fixed window of `kv_bucket` rows
under the selection's mask, hyper-connections, routers and the next layer's guess, routed and shared experts,
the PLE mixing, the final mixer. A state's buffers are baked into its graphs, so graphs are kept per `State`
and KV bucket in one memory pool per state (dropped with the state: a pool shared across states dies with the
last graph using it, and torch asserts when a capture names a dead pool); they are captured while the first
graphed step of that state and bucket runs, so no token is computed twice. `capture=False` runs the same
program without graphs: the CPU tests pin it to the model's forward.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from expertstream.experts.host_mirror import PackedUpload
from expertstream.log import get_logger
from expertstream.models.qwen4_exp import DecoderLayer, Qwen4ExpModel, Rope, kv_bucket
from expertstream.models.state import State

log = get_logger(__name__)


def _capture_graph(fn, stream: torch.cuda.Stream, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, fn's return value): fn's launches captured on `stream`, ordered after the work queued on the
    current stream so far, into `pool` (None: a pool of the graph's own). Nothing runs until a replay."""
    dev = stream.device
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        # thread_local: the store's reader threads keep synchronising their copy events meanwhile
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(dev).wait_stream(stream)
    return graph, out


@dataclass
class _Step:
    """What only the eager stages may read: the host ids [1] and the state."""

    ids: torch.Tensor
    st: State


def _rope(e: dict, model: Qwen4ExpModel) -> Rope:
    return Rope(e["positions"], e["cos"], e["sin"], model.inv_freq)


def _layer_ops(
    model: Qwen4ExpModel, i: int, layer: DecoderLayer, st: State, kv_len: int
) -> list[tuple[bool, object]]:
    """(graphable, fn(env, step) -> {name: tensor}) for one layer; graphable fns never read `step`."""
    ops = []
    if layer.ple is not None:  # its raw rows came with the token (host work); decoding and mixing is static
        ple, raw = layer.ple, f"ple_raw{i}"
        ops.append(
            (True, lambda e, s: {"x": e["x"] + ple.mix(e["x"], ple.from_raw(e[raw], e["x"].dtype), st)})
        )
    ops.append((True, lambda e, s: dict(zip(("u", "c"), layer.attn_hc(e["x"])))))
    if layer.linear_attn is not None:  # recurrent state in place: static
        ops.append((True, lambda e, s: {"y": layer.linear_attn(e["u"], st)}))
    else:  # QSA: static stages around the eager block selection (transformers' top-k over the visible)
        att = layer.self_attn
        qkv_names = ("q", "qi", "gate")
        ops.append((True, lambda e, s: dict(zip(qkv_names, att.decode_in(e["u"], st, _rope(e, model))))))
        ops.append((False, lambda e, s: {"mask": att.decode_mask(e["qi"], s.st, kv_len)}))
        ops.append((True, lambda e, s: {"y": att.decode_out(e["q"], e["gate"], e["mask"], st, kv_len)}))
    names = ("x", "u", "c", "top_i", "top_w", "shared_gate", "shared")
    ops.append((True, lambda e, s: dict(zip(names, layer.moe_in(e["x"], e["y"], e["c"])))))
    bank = layer.mlp.bank
    mode = bank.decode_mode
    if mode == "fixed":  # every block placed for good: no host work, no guesses
        ops.append((True, lambda e, s: {"routed": bank.decode_compute(i, e["u"], e["top_i"], e["top_w"])}))
    elif mode == "staged":  # a bank with slots: only its host work (fetch, map) stays eager
        ops.append((True, lambda e, s: {"want": bank.decode_want(i, e["u"], e["top_i"])}))
        ops.append((False, lambda e, s: bank.decode_prepare(i, e["want"], e["top_i"].shape[1]) or {}))
        ops.append((True, lambda e, s: {"routed": bank.decode_compute(i, e["u"], e["top_i"], e["top_w"])}))
        # the next layer's guesses to VRAM behind this kernel (side stream)
        ops.append((True, lambda e, s: bank.decode_stage(i, e["want"], e["top_i"].shape[1]) or {}))
    else:
        ops.append((False, lambda e, s: {"routed": bank(i, e["u"], e["top_i"], e["top_w"])}))
    ops.append(
        (True, lambda e, s: {"x": layer.moe_out(e["x"], e["c"], e["routed"], e["shared_gate"], e["shared"])})
    )
    return ops


def _banks(model: Qwen4ExpModel) -> list:
    """The model's distinct expert banks (layers usually share one)."""
    return list({id(layer.mlp.bank): layer.mlp.bank for layer in model.layers}.values())


def _host_inputs(model: Qwen4ExpModel, s: _Step, upload: PackedUpload) -> dict:
    # on the host (where the embedding table lives, it may be the device): one upload of all of them
    out = {"row": model.table_rows(s.ids), "positions": torch.tensor([s.st.pos])}
    for i, layer in enumerate(model.layers):
        if layer.ple is not None:
            out[f"ple_raw{i}"] = layer.ple.raw_host(s.ids, s.st)
    return upload(out)


def _embed(model: Qwen4ExpModel, e: dict) -> dict:
    rope = model.rope_at(e["positions"])
    return {"x": model.streams(e["row"]), "cos": rope.cos, "sin": rope.sin}


def decode_program(
    model: Qwen4ExpModel, st: State, kv_len: int, upload: PackedUpload | None = None
) -> list[tuple[bool, list]]:
    """The one-token step, QSA over `kv_len` KV rows, as runs of graphable / eager stages, in order;
    `upload` sends the token's host inputs (a fresh one if None)."""
    # host: the token's embedding row, its position and every PLE layer's raw rows (all known from the ids
    # and the state), in one eager stage; the streams, the RoPE rows and PLE decoding are static
    upload = upload or PackedUpload(model.device)
    ops = [
        (False, lambda e, s: _host_inputs(model, s, upload)),
        (True, lambda e, s: _embed(model, e)),
    ]
    for bank in _banks(model):  # layer 0's guesses to VRAM over its attention (side stream)
        if bank.decode_mode == "staged":
            ops.append((True, lambda e, s, bank=bank: bank.decode_stage_first(e["row"]) or {}))
    for i, layer in enumerate(model.layers):
        ops += _layer_ops(model, i, layer, st, kv_len)
    ops.append((True, lambda e, s: {"h": model.mixer(e["x"])[0]}))
    runs: list[tuple[bool, list]] = []
    for graphable, fn in ops:
        if runs and runs[-1][0] == graphable:
            runs[-1][1].append(fn)
        else:
            runs.append((graphable, [fn]))
    # a captured stretch ends joined: side-stream work it queued (staged guesses) is waited for inside it
    joins = [b.decode_join for b in _banks(model) if b.decode_mode != "eager"]
    for graphable, fns in runs:
        if graphable:
            fns.extend(lambda e, s, join=join: join() or {} for join in joins)
    return runs


def _run(fns, env: dict, step: _Step | None) -> dict:
    out: dict = {}
    for fn in fns:
        out.update(fn({**env, **out}, step))
    return out


class _Captured:
    """One state's step: per run either a graph, or eager stages with the static buffers they fill."""

    def __init__(self):
        self.segments: list = []  # ("graph", CUDAGraph) | ("eager", fns, env at that point, static outputs)
        self.h: torch.Tensor | None = None


class _StateGraphs:
    """A state's captures, one per KV window and bank mode, in one private memory pool: captures never run
    at once and every capture's outputs stay referenced, so intermediates can share memory across them."""

    def __init__(self):
        self.pool = None  # the first capture's pool, named by the later ones
        # (KV window, KV address in the pool, per bank: every block placed for good, and where blocks
        # reside): a bank that becomes fixed gets a program without its eager point per layer, one that
        # becomes resident in RAM a program with its staging copies (decided while capturing), each captured
        # anew; a capture that outlives a move of the state's KV is dropped
        self.by_window: dict[tuple, _Captured] = {}


class DecodeGraphs:
    """Runs `model` one token at a time; on CUDA through per-state CUDA graphs (see the module docstring).

    Args:
        model: the network.
        capture: False runs the same stage program without graphs (any device; tests).
    """

    def __init__(self, model: Qwen4ExpModel, capture: bool = True):
        self.model, self.capture = model, capture
        self.warm = False  # one eager step first: Triton compiles and module loads cannot be captured
        self._states: weakref.WeakKeyDictionary[State, _StateGraphs] = weakref.WeakKeyDictionary()
        self._stream = torch.cuda.Stream(model.device) if capture else None
        self._upload = PackedUpload(model.device)  # the token's host inputs: fixed device tensors
        self.captures = 0  # (state, KV bucket) programs captured so far (stats)
        self._banks = _banks(model)
        # host work a bank starts once the device work before it is queued (the next layer's guesses)
        self._launched = [b.decode_launched for b in self._banks]
        # per bank, the routed blocks one token reads: what a fixed bank counts without decode_prepare
        k = model.args.num_experts_per_tok
        self._reads = [sum(layer.mlp.bank is b for layer in model.layers) * k for b in self._banks]

    @torch.no_grad()
    def step(self, ids: torch.Tensor, st: State) -> torch.Tensor:
        """Feed one host token id [1] and advance `st` -> final mixer output [1, H] (a fresh tensor)."""
        if ids.shape != (1,):
            raise ValueError(f"decode takes one token id, got shape {tuple(ids.shape)}")
        st.check_room(1)
        ids = ids.cpu()
        step, kv_len = _Step(ids, st), kv_bucket(st.pos + 1, st.max_model_len)
        # which banks have every block placed for good: the program (and its graphs) depend on it
        fixed = tuple(b.decode_mode == "fixed" for b in self._banks)
        if not self.capture or not self.warm:
            env: dict = {}
            for graphable, fns in decode_program(self.model, st, kv_len, self._upload):
                env.update(_run(fns, env, step))
                if graphable:
                    self._after_launch()
            h = env["h"]
            self.warm = True
        else:
            graphs = self._states.setdefault(st, _StateGraphs())
            # the state's KV may move within the pool: graphs read it where they were captured
            key = (kv_len, st.kv_address, fixed, tuple(b.resident for b in self._banks))
            cap = graphs.by_window.get(key)
            if cap is None:
                # graphs of the state's KV at another address read rows it no longer holds
                graphs.by_window = {k: c for k, c in graphs.by_window.items() if k[1] == st.kv_address}
                cap = graphs.by_window[key] = self._capture(graphs, st, step, kv_len)
            else:
                self._replay(cap, step)
            h = cap.h.clone()
        for b, was_fixed, n in zip(self._banks, fixed, self._reads):
            if was_fixed:  # fixed when the program was built: its reads are counted here, not per layer
                b.decode_fixed_reads(n)
        st.advance(ids)
        return h

    def _capture(self, graphs: _StateGraphs, st: State, step: _Step, kv_len: int) -> _Captured:
        """Build the state's graphs while running this step: each run is captured, then replayed at once."""
        cap, env, t0 = _Captured(), {}, time.perf_counter()
        torch.cuda.synchronize(self.model.device)
        for graphable, fns in decode_program(self.model, st, kv_len, self._upload):
            if graphable:
                g, out = _capture_graph(lambda fns=fns: _run(fns, env, None), self._stream, graphs.pool)
                graphs.pool = graphs.pool or g.pool()  # the state's graphs share the first one's pool
                g.replay()
                self._after_launch()
                cap.segments.append(("graph", g))
                env.update(out)
            else:
                # fresh tensors get static copies; the upload's fixed tensors are static already
                out = {k: v if self._upload.owns(v) else v.clone() for k, v in _run(fns, env, step).items()}
                cap.segments.append(("eager", fns, dict(env), out))
                env.update(out)
        cap.h = env["h"]
        self.captures += 1
        graphs = sum(seg[0] == "graph" for seg in cap.segments)
        log.info(
            "decode graphs: %d captured for a %d-row KV window in %.0f ms (this token included)",
            graphs,
            kv_len,
            (time.perf_counter() - t0) * 1e3,
        )
        return cap

    def _after_launch(self) -> None:
        for fn in self._launched:
            fn()

    def _replay(self, cap: _Captured, step: _Step) -> None:
        for seg in cap.segments:
            if seg[0] == "graph":
                seg[1].replay()
                self._after_launch()
            else:
                _, fns, env, static = seg
                for name, value in _run(fns, env, step).items():
                    if static[name] is not value:
                        static[name].copy_(value)
