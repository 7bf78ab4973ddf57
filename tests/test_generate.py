"""Sampling, stop handling, stream_generate: a scripted engine for control flow, the tiny model end to end."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from expertstream.generate import SamplingParams, StopStringMatcher, stream_generate
from expertstream.sampling import apply_penalties, filter_logits, make_generator, sample, token_logprobs
from expertstream.tokenizer import Tokenizer


class ScriptedState:
    def __init__(self):
        self.tokens = []

    def reset(self):
        self.tokens = []


class ScriptedEngine:
    """Engine stand-in whose next token is script[number of tokens consumed after the prompt]."""

    def __init__(self, tokenizer, prompt_len, script, max_model_len=4096):
        self.tokenizer, self.prompt_len, self.script = tokenizer, prompt_len, script
        self.config = SimpleNamespace(max_model_len=max_model_len)
        self.device = torch.device("cpu")
        self.fed = []
        self._stats = SimpleNamespace(hits=0, misses=0, bytes_read=0, ple_bytes_read=0, stall_seconds=0.0)

    def new_state(self):
        return ScriptedState()

    def forward(self, state, ids, all_logits=False):
        self.fed.append(list(ids))
        state.tokens += list(ids)
        # every forward reads 3 "blocks" from disk and hits 1
        s = self._stats
        self._stats = SimpleNamespace(
            hits=s.hits + 1,
            misses=s.misses + 3,
            bytes_read=s.bytes_read + 3000,
            ple_bytes_read=s.ple_bytes_read + 20,
            stall_seconds=s.stall_seconds + 0.5,
        )
        logits = torch.zeros(self.tokenizer.vocab_size)
        generated = len(state.tokens) - self.prompt_len
        if generated >= 0:  # mid-prefill pieces predict nothing that is used
            logits[self.script[generated]] = 5.0
        return logits

    def stats(self):
        return self._stats


@pytest.fixture(scope="module")
def tok(tiny_snapshot):
    return Tokenizer.from_dir(tiny_snapshot)


def scripted(tok, reply: str, end: str | None = "<|im_end|>", prompt="Hi there"):
    prompt_ids = tok.encode(prompt)
    script = tok.encode(reply) + ([tok.token_to_id(end)] if end else [])
    return ScriptedEngine(tok, len(prompt_ids), script), prompt_ids, script


# --- sampling ---


def test_greedy_and_top_k_one_agree():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())
    assert sample(logits) == best
    gen = make_generator(1)
    assert all(sample(logits, 1.0, top_k=1, generator=gen) == best for _ in range(20))


def test_seeded_sampling_repeats_and_seeds_differ():
    logits = torch.zeros(1000)
    draws = [[sample(logits, 1.0, generator=make_generator(s)) for _ in range(10)] for s in (7, 7, 8)]
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]


def test_filters_keep_the_documented_sets():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    kept = lambda f: torch.isfinite(f).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, 1.0, top_k=2, top_p=1.0, min_p=0.0)) == [0, 1]
    # top_p 0.8: 0.5 + 0.3 reaches it, so 0.15 is dropped; 0.81 needs the third token
    assert kept(filter_logits(logits, 1.0, top_k=0, top_p=0.8, min_p=0.0)) == [0, 1]
    assert kept(filter_logits(logits, 1.0, top_k=0, top_p=0.81, min_p=0.0)) == [0, 1, 2]
    assert kept(filter_logits(logits, 1.0, top_k=0, top_p=0.01, min_p=0.0)) == [0]
    # a top_p below float32's smallest subnormal rounds to 0 in the comparison: the best token still stays
    # (schemathesis sent top_p = 5e-324 and the draw failed on an all -inf row)
    assert kept(filter_logits(logits, 1.0, top_k=0, top_p=5e-324, min_p=0.0)) == [0]
    # min_p 0.2: threshold 0.1 keeps 0.5, 0.3, 0.15
    assert kept(filter_logits(logits, 1.0, top_k=0, top_p=1.0, min_p=0.2)) == [0, 1, 2]
    gen = make_generator(0)
    assert {sample(logits, 1.0, top_p=0.8, generator=gen) for _ in range(200)} == {0, 1}


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 0.0])
    gen = make_generator(0)
    cold = sum(sample(logits, 0.1, generator=gen) == 0 for _ in range(300))
    hot = sum(sample(logits, 10.0, generator=gen) == 0 for _ in range(300))
    assert cold == 300 and 100 < hot < 200


def test_extreme_temperatures_stay_valid():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 30
    gen = make_generator(0)
    assert sample(logits, 1e-30, generator=gen) == int(logits.argmax())
    # below float32's smallest subnormal the divisor rounds to 0: still the argmax, never a NaN draw
    assert (
        sample(logits, 1e-46, generator=gen) == sample(logits, 5e-324, generator=gen) == int(logits.argmax())
    )
    # an enormous temperature flattens the distribution: many tokens are drawn, none invalid
    draws = {sample(logits, 1e30, top_p=0.5, min_p=0.01, generator=gen) for _ in range(50)}
    assert len(draws) > 5 and all(0 <= t < 50 for t in draws)


def test_logprobs_are_log_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0])
    lp, top = token_logprobs(logits, 1, 2)
    want = torch.log_softmax(logits, -1)
    assert math.isclose(lp, float(want[1]), rel_tol=1e-6)
    assert [i for i, _ in top] == [0, 1] and math.isclose(top[0][1], float(want[0]), rel_tol=1e-6)


def test_sampling_params_reject_bad_values():
    for bad in (
        {"temperature": -1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0},
        {"min_p": 1},
        {"top_k": -1},
        {"stop": [""]},
        {"max_tokens": -1},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# --- stop strings ---


def test_stop_string_matcher_holds_back_and_cuts():
    m = StopStringMatcher(["STOP", "\n\n"])
    assert m.feed("Hello S") == ("Hello ", False)  # "S" could start STOP
    assert m.feed("T") == ("", False)
    assert m.feed("ay") == ("STay", False)  # not a stop after all
    assert m.feed(" x\n") == (" x", False)
    assert m.feed("\nrest") == ("", True)  # "\n\n" completes: nothing after it is emitted
    m = StopStringMatcher(["abc"])
    assert m.feed("xxab") == ("xx", False)
    assert m.feed("cyy") == ("", True)
    assert StopStringMatcher([]).feed("abc") == ("abc", False)


# --- stream_generate control flow ---


def test_stop_token_ends_generation_and_is_not_emitted(tok):
    engine, prompt, script = scripted(tok, "Paris is the capital.")
    out = list(stream_generate(engine, prompt, SamplingParams(max_tokens=100)))
    assert "".join(r.text for r in out) == "Paris is the capital."
    assert [r.token for r in out] == script
    assert [r.finish_reason for r in out] == [None] * (len(out) - 1) + ["stop"]
    assert out[-1].generation_tokens == len(script) and out[-1].prompt_tokens == len(prompt)
    # the stop token is sampled but never fed back
    assert engine.fed[-1] == [script[-2]]
    # counters are deltas of engine.stats() since the request started
    forwards = len(engine.fed)
    assert out[-1].disk_bytes == 3020 * forwards and out[-1].stall_s == pytest.approx(0.5 * forwards)
    assert out[-1].cache_hit_rate == pytest.approx(0.25)


def test_stop_string_across_tokens(tok):
    engine, prompt, _ = scripted(tok, "The answer is four. Then more text")
    out = list(stream_generate(engine, prompt, SamplingParams(max_tokens=100, stop=["four. Th"])))
    assert "".join(r.text for r in out) == "The answer is "
    assert out[-1].finish_reason == "stop"


def test_length_flushes_held_text(tok):
    engine, prompt, script = scripted(tok, "Hello world again", end=None)
    n = len(script)
    out = list(stream_generate(engine, prompt, SamplingParams(max_tokens=n, stop=["again and"])))
    assert "".join(r.text for r in out) == "Hello world again"  # "again" was held, then released
    assert out[-1].finish_reason == "length" and len(out) == n


def test_context_limit_clamps_max_tokens(tok):
    engine, prompt, _ = scripted(tok, "one two three four five six", end=None)
    engine.config.max_model_len = len(prompt) + 3
    out = list(stream_generate(engine, prompt, SamplingParams(max_tokens=50)))
    assert len(out) == 3 and out[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        engine.config.max_model_len = len(prompt)
        list(stream_generate(engine, prompt))


def test_should_stop_cancels(tok):
    engine, prompt, _ = scripted(tok, "one two three four five six", end=None)
    assert list(stream_generate(engine, prompt, should_stop=lambda: True)) == []  # cancelled in prefill
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 3  # once after the prefill piece, then after each token

    out = list(stream_generate(engine, prompt, SamplingParams(max_tokens=50), should_stop=stop))
    assert out[-1].finish_reason == "cancelled" and len(out) == 3
    assert "".join(r.text for r in out) == tok.decode([r.token for r in out])


def test_prefill_progress_in_pieces(tok):
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 45
    engine, prompt, _ = scripted(tok, "ok", prompt=long_prompt)
    assert 1024 < len(prompt) < 1536
    seen = []
    out = list(
        stream_generate(
            engine, prompt, SamplingParams(max_tokens=5), on_progress=lambda d, t: seen.append((d, t))
        )
    )
    assert out[-1].finish_reason == "stop"
    assert [len(f) for f in engine.fed[:3]] == [512, 512, len(prompt) - 1024]
    assert seen == [(512, len(prompt)), (1024, len(prompt)), (len(prompt), len(prompt))]


def test_prefill_progress_follows_the_engines_span(tok):
    # an engine's span is its prefill unit: a shorter call would fetch every expert again
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 45
    engine, prompt, _ = scripted(tok, "ok", prompt=long_prompt)
    engine.prefill_span = 700
    seen = []
    list(
        stream_generate(engine, prompt, SamplingParams(max_tokens=2), on_progress=lambda d, t: seen.append(d))
    )
    assert [len(f) for f in engine.fed[:2]] == [700, len(prompt) - 700] and seen == [700, len(prompt)]


def test_prefix_reuse_runs_only_the_tail(tok):
    engine, prompt, script = scripted(tok, "Hello world", end=None, prompt="Hi there, how are you")
    state = engine.new_state()
    state.tokens = list(prompt[:3])  # as if an earlier turn consumed these
    out = list(stream_generate(engine, prompt, SamplingParams(max_tokens=2), state=state))
    assert engine.fed[0] == prompt[3:] and out[-1].cached_tokens == 3
    # a state whose history is not a prefix of the prompt is reset and the whole prompt runs
    engine.fed.clear()
    state.tokens = [prompt[0] + 1]
    out = list(stream_generate(engine, prompt, SamplingParams(max_tokens=2), state=state))
    assert engine.fed[0] == prompt and out[-1].cached_tokens == 0


def test_json_serialisable_record(tok):
    engine, prompt, _ = scripted(tok, "Hello")
    params = SamplingParams(max_tokens=4, logprobs=True, top_logprobs=2)
    r = next(iter(stream_generate(engine, prompt, params)))
    from dataclasses import asdict

    d = json.loads(json.dumps(asdict(r)))
    assert d["logprobs"] <= 0 and len(d["top_logprobs"]) == 2


# --- the tiny model end to end ---


@pytest.fixture(scope="module")
def engine(tiny_workdir):
    from expertstream.config import EngineConfig
    from expertstream.runtime.engine import Engine

    # threads fixed: the CPU sums depend on the thread count, which auto re-measures as the box's load changes
    engine = Engine(EngineConfig(model=str(tiny_workdir), max_model_len=256, threads=2))
    yield engine
    engine.close()


def chat_prompt(engine, text="What is the capital of France?"):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_greedy_follows_the_engine_argmax(engine):
    prompt = chat_prompt(engine)
    out = list(stream_generate(engine, prompt, SamplingParams(max_tokens=12)))
    state = engine.new_state()
    logits, want = engine.forward(state, engine.tokenizer.encode(prompt)), []
    for _ in out:
        want.append(int(logits.argmax()))
        logits = engine.forward(state, [want[-1]])
    assert [r.token for r in out] == want
    emitted = [t for t in want if t not in engine.tokenizer.stop_token_ids]
    assert "".join(r.text for r in out) == engine.tokenizer.decode(emitted)
    last = out[-1]
    assert last.finish_reason in ("stop", "length") and last.prompt_tps > 0 and last.generation_tps > 0
    assert last.disk_bytes > 0 and 0 <= last.cache_hit_rate <= 1 and last.peak_memory_gb > 0


def test_seeded_sampling_is_reproducible(engine):
    prompt = chat_prompt(engine)

    def run(seed):
        params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=seed, logprobs=True)
        return [(r.token, r.logprobs) for r in stream_generate(engine, prompt, params)]

    a, b, c = run(5), run(5), run(6)
    assert a == b and [t for t, _ in a] != [t for t, _ in c]


def test_follow_up_turn_reuses_the_state(engine):
    tok = engine.tokenizer
    first = tok.encode(chat_prompt(engine))
    state = engine.new_state()
    out = list(stream_generate(engine, first, SamplingParams(max_tokens=6), state=state))
    # the state holds the prompt and every generated token but the last (never fed back)
    assert state.tokens == first + [r.token for r in out[:-1]]
    follow = (
        state.tokens + [out[-1].token] + tok.encode("<|im_end|>\n<|im_start|>user\nAnd Spain?<|im_end|>\n")
    )
    reused = list(stream_generate(engine, follow, SamplingParams(max_tokens=6), state=state))
    fresh = list(stream_generate(engine, follow, SamplingParams(max_tokens=6)))
    assert reused[-1].cached_tokens == len(first) + len(out) - 1 and fresh[-1].cached_tokens == 0
    assert [r.token for r in reused] == [r.token for r in fresh]


def test_diverging_state_is_reset(engine):
    prompt = engine.tokenizer.encode(chat_prompt(engine))
    state = engine.new_state()
    engine.forward(state, engine.tokenizer.encode("Something else entirely."))
    reused = list(stream_generate(engine, prompt, SamplingParams(max_tokens=6), state=state))
    fresh = list(stream_generate(engine, prompt, SamplingParams(max_tokens=6)))
    assert reused[-1].cached_tokens == 0 and [r.token for r in reused] == [r.token for r in fresh]


def test_generate_cli_json_and_text(capsys, tiny_workdir):
    from expertstream.cli import main as cli

    args = ["generate", str(tiny_workdir), "--prompt", "Hello", "--chat", "--max-tokens", "5", "--seed", "1"]
    assert cli(args + ["--json", "--temperature", "0.8"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert 1 <= len(records) <= 5 and records[-1]["finish_reason"] in ("stop", "length")
    assert all(r["finish_reason"] is None for r in records[:-1])
    assert cli(args) == 0
    captured = capsys.readouterr()
    assert "tok/s" in captured.err and "finish:" in captured.err


def test_generate_reads_the_prompt_from_a_file_or_stdin(tiny_workdir, tmp_path, capsys, monkeypatch):
    import io
    import sys

    from expertstream.cli import main as cli

    (tmp_path / "prompt.txt").write_text("Hello")
    base = ["generate", str(tiny_workdir), "--max-tokens", "2", "--json"]
    runs = []
    for source in (
        ["--prompt", "Hello"],
        ["-f", str(tmp_path / "prompt.txt")],
        ["--prompt", "-"],
        ["-f", "-"],
    ):
        monkeypatch.setattr(sys, "stdin", io.StringIO("Hello"))
        assert cli(base + source) == 0
        runs.append(
            [(r["token"], r["prompt_tokens"]) for r in map(json.loads, capsys.readouterr().out.splitlines())]
        )
    assert runs[0] and all(run == runs[0] for run in runs)


def test_chat_loop_reuses_state_between_turns(engine):
    import argparse
    import io

    from expertstream.commands.chat import chat_loop

    args = argparse.Namespace(
        system="Be brief.",
        no_think=True,
        max_tokens=4,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        seed=None,
        stats=True,
    )
    out, err = io.StringIO(), io.StringIO()
    chat_loop(engine, args, iter(["Hi", "And then?", "/exit", "never read"]), out=out, err=err)
    stats = [line for line in err.getvalue().splitlines() if line.startswith("prompt:")]
    assert len(stats) == 2 and "(0 cached)" in stats[0] and "(0 cached)" not in stats[1]


def test_default_model_is_built_once(tmp_path, monkeypatch):
    from expertstream.default_model import model_id, resolve_model

    monkeypatch.setenv("EXPERTSTREAM_CACHE", str(tmp_path))
    assert resolve_model("/some/workdir") == "/some/workdir"
    first = Path(resolve_model(""))  # the shipped demo model
    manifest = first / "manifest.json"
    assert first.parent == tmp_path and first.name.startswith("demo-") and manifest.is_file()
    assert model_id(str(first)) == "demo" and model_id("/some/workdir") == "workdir"  # its id, as served
    stamp = manifest.stat().st_mtime_ns
    assert resolve_model("") == str(first) and manifest.stat().st_mtime_ns == stamp


def test_each_install_and_revision_of_the_demo_has_its_own_workdir(tmp_path, monkeypatch, tiny_snapshot):
    import shutil

    import expertstream.default_model as dm
    from expertstream.workdir.workdir import Workdir

    demo = tmp_path / "venv1" / "demo-snapshot"
    shutil.copytree(tiny_snapshot, demo)
    monkeypatch.setattr(dm, "DEMO_SNAPSHOT", demo)
    cache = tmp_path / "cache"
    monkeypatch.setenv("EXPERTSTREAM_CACHE", str(cache))
    first = Path(dm.resolve_model(""))
    stamp = (first / "manifest.json").stat().st_mtime_ns
    assert dm.resolve_model("") == str(first) and (first / "manifest.json").stat().st_mtime_ns == stamp
    # the same demo in another install (its PLE table is read in place): a workdir of its own, and the first
    # install's stays as it is, for a process of that install may be reading it
    other = tmp_path / "venv2" / "demo-snapshot"
    shutil.copytree(demo, other)
    monkeypatch.setattr(dm, "DEMO_SNAPSHOT", other)
    second = Path(dm.resolve_model(""))
    assert second != first and (first / "manifest.json").stat().st_mtime_ns == stamp
    assert Workdir(second).ple["shards"][0]["path"].startswith(str(other))
    assert Workdir(first).ple["shards"][0]["path"].startswith(str(demo))
    # the first install upgraded in place: a new config, then a retrained demo (same config, same shard
    # sizes, other weights): a new workdir each time, the ones no install can use any more removed
    monkeypatch.setattr(dm, "DEMO_SNAPSHOT", demo)
    config = json.loads((demo / "config.json").read_text())
    (demo / "config.json").write_text(json.dumps({**config, "demo_revision": 2}))
    revised = Path(dm.resolve_model(""))
    assert revised not in (first, second) and not first.exists() and second.is_dir()
    shard = sorted(demo.glob("model-0*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    retrained = Path(dm.resolve_model(""))
    assert retrained != revised and not revised.exists() and (retrained / "manifest.json").is_file()
    # the second install removed: its workdir goes at the next setup, and the first's still serves
    shutil.rmtree(other.parent)
    (cache / "demo-unfinished").mkdir()  # a setup stopped before its manifest
    (demo / "config.json").write_text(json.dumps({**config, "demo_revision": 3}))
    last = Path(dm.resolve_model(""))
    assert sorted(p.name for p in cache.glob("demo*")) == [last.name]


def test_penalties_follow_vllm_and_openai():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    seen = torch.tensor([True, True, False, False])  # prompt or reply tokens
    counts = torch.tensor([2.0, 0.0, 0.0, 1.0])  # times in the reply
    # repetition: a seen token's positive logit divided, its negative one multiplied
    assert apply_penalties(logits, seen, counts, repetition=2.0).tolist() == [1.0, -2.0, 0.5, 3.0]
    # frequency per occurrence in the reply, presence once
    assert apply_penalties(logits, seen, counts, frequency=0.5, presence=1.0).tolist() == [
        0.0,
        -1.0,
        0.5,
        1.5,
    ]
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)


class FixedLogits:
    """The engine with every forward's logits replaced by one fixed row: the sampler's choices alone."""

    def __init__(self, engine, row: dict[int, float]):
        self.engine = engine
        self.logits = torch.full((engine.args.vocab_size,), -10.0)
        for token, value in row.items():
            self.logits[token] = value

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def forward(self, state, ids, all_logits=False):
        return self.logits.clone()


@pytest.mark.parametrize(
    "penalty, prompt, expected",
    [
        ({}, [1, 2], [7, 7, 7, 7, 7]),
        # 7 (3) / 2 = 1.5 once seen, below 9's 2.5; 9 / 2 = 1.25 then leaves 7 on top for good
        ({"repetition_penalty": 2.0}, [1, 2], [7, 9, 7, 7, 7]),
        ({"repetition_penalty": 2.0}, [1, 7], [9, 7, 7, 7, 7]),  # the prompt's tokens count too
        ({"frequency_penalty": 1.0}, [1, 7], [7, 9, 7, 9, 11]),  # ... but not for frequency: the reply's
        ({"presence_penalty": 1.0}, [1, 2], [7, 9, 7, 7, 7]),
    ],
)
def test_stream_generate_applies_the_penalties(engine, penalty, prompt, expected):
    fixed = FixedLogits(engine, {7: 3.0, 9: 2.5, 11: 1.2})
    tokens = [r.token for r in stream_generate(fixed, prompt, SamplingParams(max_tokens=5, **penalty))]
    assert tokens == expected
