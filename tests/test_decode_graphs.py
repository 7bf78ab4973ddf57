"""The CUDA-graph decode over the model's declared stages: the stages, run eagerly or captured and replayed,
equal the layers' own forward (CPU); graphs equal eager (CUDA)."""

import gc

import pytest
import torch
from bank_helpers import ram_store

from expertstream.config import EngineConfig
from expertstream.models.batched import forward_many
from expertstream.runtime import decode_graphs
from expertstream.runtime.decode_graphs import DecodeGraphs
from expertstream.runtime.engine import Engine
from expertstream.store import ExpertStore


def continue_greedy(eng, prompt, n, step=None, st=None):
    """Logits [n + 1, V] of the prompt's last position and n greedy tokens after it, and the state."""
    step = step or (lambda st, t: eng.forward(st, [t]))
    st = st or eng.new_state()
    rows = [eng.forward(st, prompt)]
    for _ in range(n):
        rows.append(step(st, int(rows[-1].argmax())))
    return torch.stack(rows), st


def layers_step(eng):
    """One token through the layers' own forward (attention, then the bank's plain call, then the combine:
    the batched path), not through the declared stages: the reference the stages must equal."""
    return lambda st, t: eng.model.logits(forward_many(eng.model, [(torch.tensor([t]), st)], 1)[0])[0]


def test_program_splits_at_the_eager_points(tiny_workdir):
    eng = Engine(EngineConfig(model=str(tiny_workdir), device="cpu"))
    a = eng.args
    runs = DecodeGraphs(eng.model, capture=False).program(eng.new_state(), kv_len=256)
    eager = sum(len(fns) for graphable, fns in runs if not graphable)
    qsa = sum(t != "linear_attention" for t in a.layer_types)
    # the token's host inputs (embedding row, position, PLE rows) + one bank per layer + one block selection
    # per QSA layer
    assert a.ple_layers and eager == 1 + a.num_hidden_layers + qsa
    assert all(g != h for (g, _), (h, _) in zip(runs, runs[1:]))  # runs alternate: maximal stretches
    eng.close()


class Rerun:
    """A CUDA graph's stand-in on the CPU: capturing runs the stages once (as a capture and its first replay
    do); a later replay runs them again and writes what they return into the tensors the capture returned,
    as a graph writes into the same memory."""

    def __init__(self, fn):
        self.fn, self.out, self.fresh = fn, fn(), True

    def replay(self):
        if self.fresh:
            self.fresh = False
            return
        for name, new in self.fn().items():
            old = self.out[name]
            for o, n in zip(old, new) if isinstance(old, tuple) else [(old, new)]:
                o.copy_(n)

    def pool(self):
        return None


def test_captured_stages_replay_the_layers_forward_bit_for_bit(tiny_workdir, monkeypatch):
    """The declared stages, as the model's one-token forward runs them and as the runner captures and replays
    them (a `Rerun` for each graph: every later token flows through the first capture's tensors and the
    eager stages' static copies), equal the layers' own forward bit for bit across two KV windows."""
    monkeypatch.setattr(decode_graphs, "_capture_graph", lambda fn, stream, pool: (g := Rerun(fn), g.out))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
    # a fixed thread count: torch's CPU sums depend on it, and the automatic one follows the box's load
    eng = Engine(EngineConfig(model=str(tiny_workdir), device="cpu", max_model_len=512, threads=2))
    graphs = DecodeGraphs(eng.model)
    prompt = [3 + i % 200 for i in range(250)]  # the decode crosses from the 256-row KV window to 512
    want, _ = continue_greedy(eng, prompt, 10, step=layers_step(eng))
    eager, _ = continue_greedy(eng, prompt, 10)
    got, st = continue_greedy(
        eng, prompt, 10, step=lambda st, t: eng.model.logits(graphs.step(torch.tensor([t]), st))[0]
    )
    assert torch.equal(eager, want) and torch.equal(got, want)
    assert graphs.captures == 2 and st.pos == 260
    eng.close()


@pytest.mark.slow  # minutes under the Triton interpreter on a CPU; seconds on a GPU
def test_slot_bank_stages_equal_the_model_bit_for_bit(tiny_workdir, kernel_device):
    """With the GPU bank (want / prepare / compute stages; the Triton interpreter on a CPU) the program
    still equals the layers' forward (the bank's plain call), speculation included; only prepare stays
    eager."""
    pytest.importorskip("triton")
    from expertstream.experts.gpu_bank import GpuExperts

    eng = Engine(
        EngineConfig(model=str(tiny_workdir), device=kernel_device, max_model_len=512, gpu_memory_gb=4)
    )
    # half the blocks fit in RAM, fewer in VRAM: every layer reads its ids back (never resident)
    store = ExpertStore(eng.workdir, 32 * eng.workdir.layout.block_bytes, io_threads=2)
    bank = GpuExperts(eng.workdir, store, 40, eng.device)
    bank.set_router_weights({i: layer.mlp.gate.weight for i, layer in enumerate(eng.model.layers)})
    for layer in eng.model.layers:
        layer.mlp.bank = bank
    runs = DecodeGraphs(eng.model, capture=False).program(eng.new_state(), kv_len=256)
    eager = [fn for graphable, fns in runs if not graphable for fn in fns]
    a = eng.args
    assert len(eager) == 1 + a.num_hidden_layers + sum(t != "linear_attention" for t in a.layer_types)
    program = DecodeGraphs(eng.model, capture=False)
    prompt = [3 + i % 50 for i in range(20)]
    want, _ = continue_greedy(eng, prompt, 4, step=layers_step(eng))
    syncs = bank.host_syncs
    got, _ = continue_greedy(
        eng, prompt, 4, step=lambda st, t: eng.model.logits(program.step(torch.tensor([t]), st))[0]
    )
    assert torch.equal(got, want)
    assert bank.host_syncs - syncs == syncs  # one per layer and token in both
    assert bank.spec.stats.issued > 0
    assert 0 < bank.spec_seconds < bank.decode_seconds  # the guesses' host time, part of the bank's
    # the next layer's guesses start only once this layer's compute is queued (decode_launched)
    calls = []
    for name in ("decode_compute", "_speculate"):
        real = getattr(bank, name)
        setattr(bank, name, lambda *a, _n=name, _f=real, **k: calls.append((_n, a[0])) or _f(*a, **k))
    st = eng.new_state()
    eng.forward(st, prompt)
    program.step(torch.tensor([5]), st)
    spec = [i for i, (n, _) in enumerate(calls) if n == "_speculate"]
    assert spec and all(calls[i - 1] == ("decode_compute", calls[i][1] - 1) for i in spec)
    bank.close()
    store.close()
    eng.close()


@pytest.mark.slow  # minutes under the Triton interpreter on a CPU; seconds on a GPU
def test_a_fixed_bank_leaves_no_eager_point_and_equals_the_model(tiny_workdir, kernel_device):
    """Every block pinned in the RAM cache for good: once the bank adopts that, its layers are device work
    alone (no eager point per layer), the tokens equal the layers' forward bit for bit, and its reads are
    still counted, K per layer and token."""
    pytest.importorskip("triton")
    from expertstream.experts.gpu_bank import GpuExperts
    from expertstream.store.reader import pinned_alloc

    eng = Engine(
        EngineConfig(model=str(tiny_workdir), device=kernel_device, max_model_len=512, gpu_memory_gb=4)
    )
    wd, a = eng.workdir, eng.args
    store = ram_store(wd, alloc=pinned_alloc)
    bank = GpuExperts(wd, store, 40, eng.device)
    bank.set_router_weights({i: layer.mlp.gate.weight for i, layer in enumerate(eng.model.layers)})
    for layer in eng.model.layers:
        layer.mlp.bank = bank
    prompt = [3 + i % 50 for i in range(20)]
    assert bank.decode_mode == "staged"
    # the first decode layer adopts the fixed places
    want, _ = continue_greedy(eng, prompt, 4, step=layers_step(eng))
    assert bank.decode_mode == "fixed"
    runs = DecodeGraphs(eng.model, capture=False).program(eng.new_state(), kv_len=256)
    eager = sum(len(fns) for graphable, fns in runs if not graphable)
    assert eager == 1 + sum(t != "linear_attention" for t in a.layer_types)  # host inputs, QSA selections
    program, reads, syncs = DecodeGraphs(eng.model, capture=False), bank.resident_reads, bank.host_syncs
    got, _ = continue_greedy(
        eng, prompt, 4, step=lambda st, t: eng.model.logits(program.step(torch.tensor([t]), st))[0]
    )
    assert torch.equal(got, want)
    assert bank.resident_reads - reads == 4 * a.num_hidden_layers * a.num_experts_per_tok
    assert bank.host_syncs - syncs == a.num_hidden_layers  # the prompt's, one per layer; decode reads nothing
    bank.close()
    store.close()
    eng.close()


@pytest.mark.gpu  # CUDA graphs need a GPU
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_equal_eager_on_cuda(tiny_workdir, dtype):
    outs = []
    for eager in (True, False):
        cfg = EngineConfig(model=str(tiny_workdir), device="cuda", dtype=dtype, max_model_len=512,
                           gpu_memory_gb=4, enforce_eager=eager)  # fmt: skip
        eng = Engine(cfg)
        # 230 + 40 tokens: the QSA window grows from 256 to 512 rows, a second capture for this state
        rows, st = continue_greedy(eng, [3 + i % 200 for i in range(230)], 40)
        # a second conversation gets graphs of its own, and a third after the second's state (and its
        # graphs) died; the first one's replay again after a reset
        rows2, st2 = continue_greedy(eng, [5, 6, 7], 8)
        del st2
        gc.collect()
        rows3, _ = continue_greedy(eng, [9, 10], 6)
        st.reset()
        rows4, _ = continue_greedy(eng, [5, 6, 7], 8, st=st)
        outs.append((rows, rows2, rows3, rows4))
        if not eager:
            assert eng.decode.captures == 4
        eng.close()
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu  # CUDA graphs need a GPU
def test_states_decode_in_turns_from_one_shared_graph_pool(tiny_workdir):
    """Three conversations decoded in turns (the scheduler's order) through graphs give each one's eager
    tokens bit for bit, and every graph lives in the runner's one pool (a pool per state held each state's
    intermediates apart: an 8 GiB budget ran out with a few sequences)."""
    prompts = [[3 + i % 200 for i in range(40)], [7 + i % 100 for i in range(30)], [11, 12, 13]]

    def live_pools():  # memory pools holding live tensors (earlier tests' graphs may hold theirs)
        gc.collect()
        torch.cuda.empty_cache()
        return {tuple(s["segment_pool_id"]) for s in torch.cuda.memory_snapshot() if s["allocated_size"]}

    outs, before = [], live_pools()
    for eager in (True, False):
        cfg = EngineConfig(model=str(tiny_workdir), device="cuda", dtype="bfloat16", max_model_len=512,
                           gpu_memory_gb=4, enforce_eager=eager)  # fmt: skip
        eng = Engine(cfg)
        states = [eng.new_state() for _ in prompts]
        rows = [[eng.forward(st, p)] for st, p in zip(states, prompts)]
        for _ in range(10):
            for st, r in zip(states, rows):
                r.append(eng.forward(st, [int(r[-1].argmax())]))
        outs.append([torch.stack(r) for r in rows])
        if not eager:
            new = live_pools() - before
            assert new - {(0, 0)} == {tuple(eng.decode.pool)}, (new, before, eng.decode.pool)
            assert eng.decode.captures >= 3
            assert 0 < eng.gpu_memory()["decode_graphs"] <= eng.gpu_memory()["reserved"]
        eng.close()
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu  # CUDA graphs need a GPU
@pytest.mark.parametrize("cache_blocks", [0, 40])  # 40: a hot set in VRAM beside the staging rows
def test_staged_guesses_in_graphs_equal_eager_on_cuda(tiny_workdir, cache_blocks):
    """Every block in RAM and guesses staged on a side stream: the captured side stream joins inside each
    graph, graphs give the eager tokens bit for bit, and the device counts add up to the bus bytes (a count
    made on one stream and added on the other had turned them into garbage in graphs)."""
    outs = []
    for eager in (True, False):
        cfg = EngineConfig(model=str(tiny_workdir), device="cuda", max_model_len=512, gpu_memory_gb=4,
                           ram_cache_gb=1, stage_guesses=2, enforce_eager=eager)  # fmt: skip
        eng = Engine(cfg, vram_cache_blocks=cache_blocks)
        wd = eng.workdir
        for h in eng.store.request([(i, e) for i in range(wd.num_layers) for e in range(wd.num_experts)]):
            h.wait()
            h.release()
        rows, _ = continue_greedy(eng, [3 + i % 50 for i in range(40)], 12)
        s = eng.stats()
        assert eng.bank.resident == "ram" and s.staged_blocks > 0 and s.stage_hits > 0
        assert (s.hot_hits > 0) == (cache_blocks > 0) and bool(eng.bank.hot_set(0)) == (cache_blocks > 0)
        assert s.staged_blocks <= 13 * wd.num_layers * 2 and s.stage_hits <= s.staged_blocks
        in_place = eng.bank.cache.stats.in_place
        assert s.bus_read_bytes == (in_place + s.resident_ram_reads + s.staged_blocks) * wd.layout.block_bytes
        outs.append(rows)
        eng.close()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@pytest.mark.slow  # minutes under the Triton interpreter on a CPU; seconds on a GPU
@pytest.mark.parametrize("n_slots", [16, 40])
def test_staged_stages_equal_the_model_bit_for_bit(tiny_workdir, kernel_device, n_slots):
    """Every block in RAM and 2 guesses staged per layer (the Triton interpreter on a CPU): the program's
    stage and join steps change no logit, and the staged blocks were found by the kernel. With 40 slots
    the bank also holds a hot set in VRAM (`hot_split`), read and counted inside the program's steps."""
    pytest.importorskip("triton")
    from expertstream.experts.gpu_bank import GpuExperts
    from expertstream.store.reader import pinned_alloc

    eng = Engine(
        EngineConfig(model=str(tiny_workdir), device=kernel_device, max_model_len=512, gpu_memory_gb=4)
    )
    wd = eng.workdir
    # pinned as the engine's store is: on CUDA the kernel reads only registered host rows in place
    nbytes = wd.num_layers * wd.num_experts * wd.layout.block_bytes
    store = ExpertStore(wd, nbytes, io_threads=2, alloc=pinned_alloc)
    for h in store.request([(i, e) for i in range(wd.num_layers) for e in range(wd.num_experts)]):
        h.wait()
        h.release()
    bank = GpuExperts(wd, store, n_slots, eng.device, stage_guesses=2)
    bank.set_router_weights({i: layer.mlp.gate.weight for i, layer in enumerate(eng.model.layers)})
    for layer in eng.model.layers:
        layer.mlp.bank = bank
    program = DecodeGraphs(eng.model, capture=False)
    prompt = [3 + i % 50 for i in range(20)]
    want, _ = continue_greedy(eng, prompt, 4, step=layers_step(eng))
    staged = bank.stage_counts()[0]
    got, _ = continue_greedy(
        eng, prompt, 4, step=lambda st, t: eng.model.logits(program.step(torch.tensor([t]), st))[0]
    )
    assert torch.equal(got, want)
    assert bank.resident == "ram" and staged > 0 and bank.stage_counts()[1] > 0
    assert bool(bank.hot_set(0)) == (n_slots == 40)
    if n_slots == 40:  # guesses in the hot set are not copied: the count below holds without one
        hits = bank.hot_hits()
        assert (
            hits > 0
            and bank.bytes_in_place
            == (bank.resident_ram_reads - bank.stage_counts()[1] - hits + bank.stage_counts()[0])
            * wd.layout.block_bytes
        )
    else:  # the program stages what the bank's plain call does, and layer 0's 2 guesses at each token's start
        assert bank.stage_counts()[0] - staged == staged + 4 * 2
    bank.close()
    store.close()
    eng.close()
