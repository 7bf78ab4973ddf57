"""Several sequences at once (issue 36): the batched engine pass, the scheduler, and the plan's count.

Greedy output of every request in a batch must be byte-identical to the same request alone; the tiny model's
random weights make near-ties common, so any difference in the sums would show.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from expertstream.config import EngineConfig
from expertstream.generate import SamplingParams
from expertstream.memory_plan import GiB, plan_memory
from expertstream.runtime.engine import Engine
from expertstream.runtime.worker import EngineBackend

PROMPT_LENS = (37, 5, 60)


@pytest.fixture(scope="module", params=[None, 16], ids=["one-piece", "layer-major"])
def engine(request, tiny_workdir):
    # piece 16: prompts longer than a piece run layer by layer in pieces, as a GPU plan cuts them. Threads
    # fixed: the CPU sums depend on the thread count, which auto re-measures as the box's load changes
    engine = Engine(
        EngineConfig(
            model=str(tiny_workdir), device="cpu", max_model_len=512, prefill_piece=request.param, threads=2
        )
    )
    yield engine
    engine.close()


def prompts(engine, lens=PROMPT_LENS):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, engine.args.vocab_size, (n,), generator=g).tolist() for n in lens]


def test_forward_batch_equals_each_sequence_alone(engine):
    ps = prompts(engine)
    alone = []
    for p in ps:
        st = engine.new_state()
        first = engine.forward(st, p)
        alone.append((first, engine.forward(st, [int(first.argmax())])))
    states = [engine.new_state() for _ in ps]
    reads = engine.stats().requests
    firsts = engine.forward_batch(list(zip(states, ps)))
    batch_reads = engine.stats().requests - reads
    seconds = engine.forward_batch([(st, [int(f.argmax())]) for st, f in zip(states, firsts)])
    for (a1, a2), b1, b2 in zip(alone, firsts, seconds):
        assert torch.equal(a1, b1) and torch.equal(a2, b2)
    # one sweep: each layer's distinct experts requested once for all three prompts
    assert batch_reads <= engine.args.num_hidden_layers * engine.workdir.num_experts
    assert [st.tokens for st in states] == [p + [int(f.argmax())] for p, f in zip(ps, firsts)]


def test_a_decode_token_and_a_prompt_share_a_pass(engine):
    a, b = prompts(engine, (20, 45))
    st = engine.new_state()
    engine.forward(st, a)
    mixed = engine.forward_batch([(st, [7]), (engine.new_state(), b)])
    ref_state = engine.new_state()
    engine.forward(ref_state, a)
    assert torch.equal(mixed[0], engine.forward(ref_state, [7]))
    assert torch.equal(mixed[1], engine.forward(engine.new_state(), b))


def collect(backend, ids, params, streaming=False, events=None, stop=lambda: False):
    """Submit and return (future, token records)."""
    out = []

    def emit(kind, *rest):
        if kind == "token":
            out.append(rest[0])
        if events is not None:
            events.append((kind, time.monotonic()))

    return backend.submit(ids, params, emit, stop, streaming), out


def test_concurrent_requests_equal_each_alone(engine):
    backend = EngineBackend(lambda: engine, max_queue=8, state_cache_bytes=1 << 20)
    backend.loaded.result(30)
    chat = engine.tokenizer.apply_chat_template
    users = ["One fish", "Two plus two is", "The city by the river", "A long way home"]
    ids = [chat([{"role": "user", "content": u}], enable_thinking=False) for u in users]
    params = [SamplingParams(max_tokens=n) for n in (12, 5, 9, 16)]
    alone = []
    for i, p in zip(ids, params):
        fut, out = collect(backend, i, p)
        fut.result(60)
        alone.append([r.token for r in out])
    fresh = EngineBackend(lambda: engine, max_queue=8, state_cache_bytes=1 << 20)
    fresh.loaded.result(30)
    calls, real = [], engine.forward_batch

    def counting(items):
        calls.append(len(items))
        return real(items)

    engine.forward_batch = counting
    try:
        runs = [collect(fresh, i, p, streaming=k % 2 == 0) for k, (i, p) in enumerate(zip(ids, params))]
        for fut, _ in runs:
            fut.result(60)
    finally:
        del engine.forward_batch
    assert [[r.token for r in out] for _, out in runs] == alone
    assert max(calls) == len(users)  # they really ran together


def test_a_request_never_waits_for_another_to_finish(engine):
    backend = EngineBackend(lambda: engine, max_queue=8, state_cache_bytes=0)
    backend.loaded.result(30)
    long_events, short_events = [], []
    a, b = prompts(engine, (30, 12))
    done = threading.Event()
    first, long_out = collect(
        backend, a, SamplingParams(max_tokens=400), events=long_events, stop=done.is_set
    )
    while not any(k == "token" for k, _ in long_events):
        time.sleep(0.01)
    second, out = collect(backend, b, SamplingParams(max_tokens=3), events=short_events)
    second.result(60)
    assert len(out) == 3 and not first.done()  # the short one finished while the long one still ran
    done.set()
    first.result(60)
    assert long_out[-1].finish_reason == "cancelled"


class OneAtATime:
    """An engine with room for one sequence whose steps wait until the test lets them go."""

    def __init__(self, engine):
        self.inner, self.max_num_seqs, self.gate = engine, 1, threading.Event()
        self.tokenizer, self.config, self.device = engine.tokenizer, engine.config, engine.device
        self.prefill_span = engine.prefill_span

    def new_state(self):
        return self.inner.new_state()

    def stats(self):
        return self.inner.stats()

    def forward_batch(self, items):
        self.gate.wait(30)
        return self.inner.forward_batch(items)


def test_streaming_requests_go_first_when_the_batch_is_full(engine):
    slow = OneAtATime(engine)
    backend = EngineBackend(lambda: slow, max_queue=8, state_cache_bytes=0)
    backend.loaded.result(30)
    a, b, c = prompts(engine, (8, 9, 10))
    order = []

    def submit(ids, streaming, name):
        def emit(kind, *_):
            if kind == "start":
                order.append(name)

        return backend.submit(ids, SamplingParams(max_tokens=2), emit, lambda: False, streaming)

    running = submit(a, False, "running")
    while backend.worker.running == 0:
        time.sleep(0.01)
    later = [submit(b, False, "task"), submit(c, True, "chat")]  # the task waits longer than the chat
    slow.gate.set()
    for f in [running, *later]:
        f.result(60)
    assert order == ["running", "chat", "task"]


def test_server_clients_in_parallel_equal_each_alone(tiny_workdir):
    import openai
    from server_helpers import LiveServer, real_settings

    from expertstream.server.app import create_app

    engine = Engine(
        EngineConfig(model=str(tiny_workdir), device="cpu", max_model_len=512, max_num_seqs=3, threads=2)
    )
    server = LiveServer(create_app(real_settings(), engine.tokenizer, lambda: engine))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    asks = [("Hello there", 10, True), ("Count to five", 7, False), ("Why is the sky blue", 12, True)]

    def ask(args):
        content, n, stream = args
        kw = dict(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=n)
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
        )

    try:
        alone = [ask(a) for a in asks]
        with ThreadPoolExecutor(len(asks)) as pool:
            together = list(pool.map(ask, asks))
    finally:
        server.stop()
        engine.close()
    assert together == alone


def test_the_plan_counts_each_sequence():
    from test_memory_plan import BLOCK, real_resident, real_text_config

    one = plan_memory(real_text_config(), real_resident(), BLOCK, 24 * GiB, 32768)
    three = plan_memory(real_text_config(), real_resident(), BLOCK, 24 * GiB, 32768, max_num_seqs=3)
    assert (one.max_num_seqs, three.max_num_seqs) == (1, 3)
    # the two more sequences' states, and the pool's two more contexts, come out of the VRAM cache
    assert three.kv_pool_tokens == 3 * one.kv_pool_tokens == 3 * 32768
    pool_bytes = (three.kv + three.indexer_keys) * 2 // 3
    assert one.vram_cache - three.vram_cache >= 2 * three.seq_bytes + pool_bytes - three.block_bytes
    assert "2 more sequences" in three.describe()
    # at 8 GiB the sequences share one 32k context's pool and a little more; the plan says so
    tight = plan_memory(real_text_config(), real_resident(), BLOCK, 8 * GiB, 32768, max_num_seqs=4)
    assert tight.max_num_seqs == 3 and "3 of --max-num-seqs 4 sequences fit" in tight.describe()
    assert 32768 <= tight.kv_pool_tokens < 2 * 32768
