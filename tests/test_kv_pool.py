"""The shared KV pool (models/kv_pool.py): sequences take ranges of one pool as their contexts grow, move and
swap to host RAM when it is full, and their outputs stay byte-identical to a whole-context state's."""

import pytest
import torch

from expertstream.config import EngineConfig
from expertstream.generate import SamplingParams
from expertstream.memory_plan import KV_BLOCK, GiB, plan_memory
from expertstream.models.state import KVPoolFull, State
from expertstream.runtime.engine import Engine
from expertstream.runtime.worker import EngineBackend

MAX_LEN = 512


@pytest.fixture(scope="module")
def engine(tiny_workdir):
    # a pool of one context and one block more: two sequences past 256 tokens cannot both stay. Threads
    # fixed: the CPU sums depend on the thread count, which auto re-measures as the box's load changes
    cfg = EngineConfig(model=str(tiny_workdir), device="cpu", max_model_len=MAX_LEN, max_num_seqs=3,
                       threads=2, kv_pool_tokens=MAX_LEN + KV_BLOCK)  # fmt: skip
    engine = Engine(cfg)
    yield engine
    engine.close()


def ids_of(engine, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.args.vocab_size, (n,), generator=g).tolist()


def whole(engine) -> State:
    """A state with its own KV for the whole context, as before the pool."""
    return State(engine.args, MAX_LEN, engine.dtype, engine.device)


def greedy(engine, st, prompt, n):
    out, logits = [], engine.forward(st, prompt)
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = engine.forward(st, [out[-1]])
    return out, logits


def test_pooled_sequences_that_move_and_swap_equal_whole_context_ones(engine):
    pool = engine.kv_pool
    a, b = ids_of(engine, 240, 1), ids_of(engine, 200, 2)
    whole_a = whole(engine)
    ref_a, logits_a = greedy(engine, whole_a, a, 30)  # 240 -> 270 tokens: past one block
    ref_b, logits_b = greedy(engine, whole(engine), b, 80)
    sa, sb = engine.new_state(), engine.new_state()
    moves, swaps = pool.moves, pool.swaps
    # interleaved: a grows to two blocks, b to two, and the pool holds three: each growth swaps the other out
    got_a, got_b = [], []
    la, lb = engine.forward(sa, a), engine.forward(sb, b)
    for i in range(80):
        if i < 30:
            got_a.append(int(la.argmax()))
            la = engine.forward(sa, [got_a[-1]])
        got_b.append(int(lb.argmax()))
        lb = engine.forward(sb, [got_b[-1]])
    assert (got_a, got_b) == (ref_a, ref_b)
    assert torch.equal(la, logits_a) and torch.equal(lb, logits_b)
    assert pool.swaps > swaps and pool.moves + pool.swaps > moves + swaps
    # a swapped-out state comes back whole: its snapshot equals the one of a state that never left
    snap, ref = sa.snapshot(), whole_a.snapshot()
    assert snap.pos == ref.pos and all(torch.equal(snap.tensors[k], v) for k, v in ref.tensors.items())


def test_a_sequence_that_may_not_take_anothers_room_is_refused(engine):
    first, second = engine.new_state(), engine.new_state()
    engine.forward(first, ids_of(engine, 300, 3))  # two of the pool's three blocks
    with pytest.raises(KVPoolFull, match="no room for 300 tokens"):
        second.check_room(300, keep=[first])
    assert second.pos == 0 and first.pos == 300


def test_the_scheduler_runs_more_sequences_than_the_pool_holds_whole(engine):
    backend = EngineBackend(lambda: engine, max_queue=8, state_cache_bytes=0)
    backend.loaded.result(30)
    prompts = [ids_of(engine, n, 10 + n) for n in (250, 180, 120)]
    params = SamplingParams(max_tokens=90)

    def run(ids):
        out = []
        fut = backend.submit(ids, params, lambda kind, *r: out.append(r[0]) if kind == "token" else None,
                             lambda: False)  # fmt: skip
        return fut, out

    alone = []
    for p in prompts:
        fut, out = run(p)
        fut.result(120)
        alone.append([r.token for r in out])
    swaps = engine.kv_pool.swaps
    runs = [run(p) for p in prompts]
    for fut, _ in runs:
        fut.result(120)
    assert [[r.token for r in out] for _, out in runs] == alone
    assert engine.kv_pool.swaps > swaps  # the pool was full: some waited in host RAM and came back


def test_an_8gib_card_at_the_defaults_holds_two_sequences_at_32k():
    from test_memory_plan import BLOCK, real_resident, real_text_config

    cfg = EngineConfig()  # the defaults: 32k context, 0.9 of the card, --max-num-seqs
    budget = int(cfg.gpu_memory_utilization * 8 * GiB)
    plan = plan_memory(real_text_config(), real_resident(), BLOCK, budget, cfg.max_model_len,
                       max_num_seqs=cfg.max_num_seqs)  # fmt: skip
    assert plan.max_num_seqs >= 2 and plan.kv_pool_tokens >= 32768
    # each sequence has its own fixed-size state; the KV of the pool's tokens is counted once
    per_token = 12 * (2 * 2 * 256 + 128) * 2
    assert (plan.kv + plan.indexer_keys) == plan.kv_pool_tokens * per_token
    assert plan.seq_bytes == plan.state + plan.seq_workspace < 0.2 * GiB
    text = plan.describe()
    assert "KV pool (32,768 tokens" in text and "2 sequences share a KV pool" in text
    # the second sequence's state came out of the prompt span, and the plan says so
    one = plan_memory(real_text_config(), real_resident(), BLOCK, budget, cfg.max_model_len, max_num_seqs=1)
    assert plan.prefill_span < one.prefill_span and "lm_head.weight" not in plan.fp8
    assert f"{plan.prefill_span}-token spans instead of {one.prefill_span}" in text
    with pytest.raises(ValueError, match="cannot hold one 32768-token context"):
        plan_memory(real_text_config(), real_resident(), BLOCK, 8 * GiB, 32768, kv_pool_tokens=16384)


def test_from_the_first_budget_that_holds_two_every_larger_one_does():
    from test_memory_plan import BLOCK, real_resident, real_text_config

    def plan(gib):
        return plan_memory(real_text_config(), real_resident(), BLOCK, int(gib * GiB), 32768, max_num_seqs=4)

    # the second sequence's state may cost BF16 matrices (the attention projections), never the LM head
    budgets = [6.6 + 0.1 * i for i in range(55)]
    seqs = [plan(b).max_num_seqs for b in budgets]
    first = next(i for i, n in enumerate(seqs) if n >= 2)
    assert budgets[first] <= 7.2 and min(seqs[first:]) >= 2  # 7.2: the default 0.9 x 8 GiB
    assert "lm_head.weight" not in plan(7.2).fp8


def test_plan_of_the_real_config_shows_two_sequences_sharing_the_pool(tiny_snapshot, tmp_path, capsys):
    import json

    from test_memory_plan import real_text_config

    from expertstream.cli import main as cli_main

    cfg = json.loads((tiny_snapshot / "config.json").read_text())
    cfg["text_config"].update(real_text_config(), max_position_embeddings=262144)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["plan", str(tmp_path / "config.json"), "--gpu-memory-gb", "8"]  # at the default utilization
    assert cli_main([*argv, "--disk-gbps", "3", "--pcie-gbps", "25"]) == 0
    out = capsys.readouterr().out
    assert "KV pool (32,768 tokens, shared by the sequences)" in out and "1 more sequence (state" in out
    assert "2 of --max-num-seqs 4 sequences fit" in out


def test_a_full_pool_never_swaps_a_streaming_request_out_for_a_task(engine, monkeypatch):
    backend = EngineBackend(lambda: engine, max_queue=8, state_cache_bytes=0)
    backend.loaded.result(30)
    pool, swapped, fitting, running = engine.kv_pool, [], [], []
    real_swap, real_fit = pool.swap_out, pool.fit

    def fit(st, *a, **kw):
        fitting.append(st)
        try:
            return real_fit(st, *a, **kw)
        finally:
            fitting.pop()

    def swap_out(st):  # a state swapped out for another (not its own round trip while the others move)
        if st is not fitting[-1] and not (running and running[-1].done()):  # the chat still running
            swapped.append(st.tokens[:8])  # whose it was: its first prompt tokens
        real_swap(st)

    monkeypatch.setattr(pool, "fit", fit)
    monkeypatch.setattr(pool, "swap_out", swap_out)
    task_ids, chat_ids = ids_of(engine, 240, 30), ids_of(engine, 230, 31)

    def submit(ids, streaming):
        return backend.submit(ids, SamplingParams(max_tokens=80), lambda *_: None, lambda: False, streaming)

    # both grow past 256 tokens: one context and one block cannot hold both ranges
    task, chat = submit(task_ids, streaming=False), submit(chat_ids, streaming=True)
    running.append(chat)
    chat.result(120)
    task.result(120)
    assert task_ids[:8] in swapped and chat_ids[:8] not in swapped
