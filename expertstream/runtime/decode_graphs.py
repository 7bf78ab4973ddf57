"""One decode token as CUDA graphs over the model's own stages: each stretch of graphable stages between the
points that must stay eager is captured once and replayed.

The model declares a token's forward once, as stages (`Qwen4ExpModel.decode_stages`, models/stages.py); its
one-token `forward` runs them eagerly, this runner captures them. Eager points: the token's host inputs, in
one stage: its embedding row, its position and every PLE layer's rows (hashed and read on the host, uploaded
as stored through `PackedUpload`, whose device tensors never move); the streams, RoPE rows, PLE decoding and
PLE maths made from them are captured. Then each QSA layer's block selection (transformers' top-k runs over
exactly the visible blocks, a length that follows the position) and the expert bank's host work, as its
`decode_mode` splits it (experts/bank.py): a "staged" bank reads the routing ids back to fetch experts and
keeps only that eager, its kernels read the slots through fixed addresses and are captured; a "fixed" bank,
whose blocks all have a fixed place, has no host work left and no eager point: its programs are captured
anew once it is. Everything between two of them keeps its shapes and addresses from token to token: whole
GDN layers, QSA projections, KV writes and attention over a fixed window of `kv_bucket` rows under the
selection's mask, hyper-connections, routers and the next layer's guess, routed and shared experts, the PLE
mixing, the final mixer. A captured run ends with the joins its stages name (side-stream staging), and the
host work its stages name to follow them (`after`: the next layer's guessed disk reads) runs once it is
replayed. Eager stages' fresh outputs are copied into static buffers the graphs after them read.

A state's buffers are baked into its graphs, so graphs are kept per `State` and KV bucket (dropped with the
state); they are captured while the first graphed step of that state and bucket runs, so no token is
computed twice. Every state's graphs share one memory pool: steps never run at once (one stream, one step
at a time) and every capture's outputs stay referenced while it lives, so one capture's intermediates may
take memory another's freed, and the pool holds one step's intermediates plus each capture's static
outputs instead of one step's intermediates per state (the VRAM plan counts it once, memory_plan.py). A
one-kernel anchor graph holds the pool for the runner's life: a pool dies with the last graph using it,
and torch refuses a capture into a dead pool. `capture=False` runs the same stages without graphs.
"""

from __future__ import annotations

import collections
import time
import weakref

import torch

from expertstream.experts.host_mirror import PackedUpload
from expertstream.log import get_logger
from expertstream.models.attention import kv_bucket
from expertstream.models.qwen4_exp import Qwen4ExpModel
from expertstream.models.stages import Stage, run_stages
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


def stretches(stages: list[Stage]) -> list[tuple[bool, list[Stage]]]:
    """The stages as maximal runs of graphable / eager ones, in order: (graphable, stages) each."""
    runs: list[tuple[bool, list[Stage]]] = []
    for stage in stages:
        if runs and runs[-1][0] == stage.graphable:
            runs[-1][1].append(stage)
        else:
            runs.append((stage.graphable, [stage]))
    return runs


def _run(stages: list[Stage], env: dict) -> dict:
    """One run's stages on `env` -> what they wrote. A run ends joined: side-stream work its stages queued
    (staged guesses) is waited for inside it, as a capture must."""
    out: dict = {}
    for stage in stages:
        out.update(stage({**env, **out}))
    for join in dict.fromkeys(s.join for s in stages if s.join is not None):
        join()
    return out


def _after(stages: list[Stage]) -> None:
    """The host work that follows a run's device work once it is queued (replayed or launched); a hook that
    several stages name (a bank's `decode_launched`) runs once."""
    for fn in dict.fromkeys(fn for stage in stages for fn in stage.after):
        fn()


class _Captured:
    """One state's step: per run either a graph, or eager stages with the static buffers they fill."""

    def __init__(self):
        # ("graph", CUDAGraph, its stages) | ("eager", stages, env at that point, static outputs)
        self.segments: list = []
        self.h: torch.Tensor | None = None


class _StateGraphs:
    """A state's captures, one per KV window and bank mode (in the runner's shared pool)."""

    def __init__(self):
        # (KV window, KV address in the pool, per bank its `decode_key`: every block placed for good, where
        # blocks reside, a CPU share's size): a bank that becomes fixed gets a program without its eager
        # point per layer, one that becomes resident in RAM a program with its staging copies (decided while
        # capturing), each captured anew; a capture that outlives a move of the state's KV is dropped
        self.by_window: dict[tuple, _Captured] = {}


class DecodeGraphs:
    """Runs `model` one token at a time; on CUDA through per-state CUDA graphs (see the module docstring).

    Args:
        model: the network; it declares a token's stages (`decode_stages`).
        capture: False runs the same stages without graphs (any device; tests).
    """

    def __init__(self, model: Qwen4ExpModel, capture: bool = True):
        self.model, self.capture = model, capture
        self.warm = False  # one eager step first: Triton compiles and module loads cannot be captured
        self._states: weakref.WeakKeyDictionary[State, _StateGraphs] = weakref.WeakKeyDictionary()
        self._stream = torch.cuda.Stream(model.device) if capture else None
        self._upload = PackedUpload(model.device)  # the token's host inputs: fixed device tensors
        self.captures = 0  # (state, KV bucket) programs captured so far (stats)
        self._banks = model.banks  # what a step's program depends on, beside the state and the KV window
        self._anchor: torch.cuda.CUDAGraph | None = None  # holds the states' shared pool (module docstring)
        self._timed: _Captured | None = None  # the last replayed token's program, timed by `_events`
        self._events: tuple | None = None  # CUDA events (before, after) around it, made once and re-recorded
        # the last replayed tokens' GPU seconds, as reported to the banks
        self.token_seconds: collections.deque[float] = collections.deque(maxlen=1024)

    def program(self, st: State, kv_len: int) -> list[tuple[bool, list[Stage]]]:
        """The model's stages of one token on `st`, QSA over `kv_len` KV rows, as runs to capture or run."""
        return stretches(self.model.decode_stages(st, kv_len, self._upload))

    @torch.no_grad()
    def step(self, ids: torch.Tensor, st: State) -> torch.Tensor:
        """Feed one host token id [1] and advance `st` -> final mixer output [1, H] (a fresh tensor)."""
        if ids.shape != (1,):
            raise ValueError(f"decode takes one token id, got shape {tuple(ids.shape)}")
        st.check_room(1)
        ids, kv_len = ids.cpu(), kv_bucket(st.pos + 1, st.max_model_len)
        if not self.capture or not self.warm:
            h = run_stages(self.model.decode_stages(st, kv_len, self._upload), {"ids": ids})["h"]
            self.warm = True
        else:
            graphs = self._states.setdefault(st, _StateGraphs())
            # the program (and its graphs) depends on the banks' `decode_key` (which have every block placed
            # for good, and where); the state's KV may move within the pool: graphs read it where captured
            key = (kv_len, st.kv_address, tuple(b.decode_key for b in self._banks))
            cap = graphs.by_window.get(key)
            if cap is None:
                # graphs of the state's KV at another address read rows it no longer holds
                graphs.by_window = {k: c for k, c in graphs.by_window.items() if k[1] == st.kv_address}
                cap = graphs.by_window[key] = self._capture(graphs, st, ids, kv_len)
            else:
                self._timed_replay(cap, ids)
            h = cap.h.clone()
        st.advance(ids)
        return h

    @property
    def pool(self):
        """The memory pool every state's graphs are captured into (made with the first capture)."""
        if self._anchor is None:
            one = torch.zeros(1, device=self.model.device)
            self._anchor, _ = _capture_graph(lambda: one.add_(1), self._stream, None)
        return self._anchor.pool()

    def pool_bytes(self) -> int:
        """Device memory the shared pool holds now (its segments, reserved whether in use or not)."""
        if self._anchor is None:
            return 0
        pool = tuple(self._anchor.pool())
        return sum(
            seg["total_size"]
            for seg in torch.cuda.memory_snapshot()
            if tuple(seg.get("segment_pool_id", ())) == pool
        )

    def _capture(self, graphs: _StateGraphs, st: State, ids: torch.Tensor, kv_len: int) -> _Captured:
        """Build the state's graphs while running this step: each run is captured, then replayed at once."""
        cap, env, t0 = _Captured(), {}, time.perf_counter()
        torch.cuda.synchronize(self.model.device)
        # a capture allocates in the graphs' pool, which cannot take the blocks the default pool caches (a
        # prompt's freed workspace, up to the plan's prefill share): give those back to the driver first, or
        # a capture under the enforced budget runs out with them cached and unused
        torch.cuda.empty_cache()
        for graphable, stages in self.program(st, kv_len):
            if graphable:  # graphable stages never see the host id; they read the values of this point
                fn = lambda stages=stages, env=dict(env): _run(stages, env)  # noqa: E731
                g, out = _capture_graph(fn, self._stream, self.pool)
                g.replay()
                cap.segments.append(("graph", g, stages))
            else:
                # fresh tensors get static copies; the upload's fixed tensors are static already
                out = _run(stages, {**env, "ids": ids})
                out = {k: v if self._upload.owns(v) else v.clone() for k, v in out.items()}
                cap.segments.append(("eager", stages, dict(env), out))
            _after(stages)
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

    def _timed_replay(self, cap: _Captured, ids: torch.Tensor) -> None:
        """`_replay` between two CUDA events. The last replayed token's GPU time goes to the banks
        (`decode_token_seconds`) if it replayed the same program (the banks' choices and the state alike)
        and its events are done (the caller read its logits), else not at all."""
        if self.model.device.type != "cuda":  # graphs faked by a test
            return self._replay(cap, ids)
        if self._events is None:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        before, after = self._events
        if self._timed is cap and after.query():
            seconds = before.elapsed_time(after) / 1e3
            self.token_seconds.append(seconds)
            for bank in self._banks:
                bank.decode_token_seconds(seconds)
        self._timed = cap
        before.record()
        self._replay(cap, ids)
        after.record()

    def _replay(self, cap: _Captured, ids: torch.Tensor) -> None:
        for seg in cap.segments:
            if seg[0] == "graph":
                _, graph, stages = seg
                graph.replay()
            else:
                _, stages, env, static = seg
                for name, value in _run(stages, {**env, "ids": ids}).items():
                    if static[name] is not value:
                        static[name].copy_(value)
            _after(stages)
