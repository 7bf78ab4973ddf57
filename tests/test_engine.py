"""The Engine on the tiny synthetic workdir against our model on the snapshot's own decoded weights."""

import json

import pytest
import torch
from safetensors import safe_open

from expertstream.config import EngineConfig
from expertstream.experts.cpu_bank import DenseExperts
from expertstream.formats import nvfp4
from expertstream.formats.fp8 import dequantize_fp8_rows, e4m3_to_float
from expertstream.models.qwen4_exp import Qwen4ExpModel
from expertstream.models.state import State
from expertstream.runtime.engine import Engine
from expertstream.store.ple import DenseTable, PleTable
from expertstream.workdir.repack import setup_workdir

PREFIX = "model.language_model."
PROMPT = 100


def read_snapshot(path) -> dict[str, torch.Tensor]:
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(path / shard, framework="pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


def reference_model(snapshot, engine: Engine) -> Qwen4ExpModel:
    """Our network on weights decoded straight from the snapshot (no workdir, store or PLE reader)."""
    snap, args = read_snapshot(snapshot), engine.args
    ple_base = f"{PREFIX}layers.{args.ple_layers[0]}.ple.ple_embedding.ngram_embedding"
    gate_up, down = [], []
    for layer in range(args.num_hidden_layers):
        experts = []
        for e in range(args.num_experts):
            p = f"{PREFIX}layers.{layer}.mlp.experts.{e}"
            g, u, d = (
                nvfp4.dequantize(
                    snap[f"{p}.{j}.weight"], snap[f"{p}.{j}.weight_scale"], snap[f"{p}.{j}.weight_scale_2"]
                )
                for j in ("gate_proj", "up_proj", "down_proj")
            )
            experts.append((torch.cat((g, u)), d))
        gate_up.append(torch.stack([gu for gu, _ in experts]))
        down.append(torch.stack([d for _, d in experts]))
    shards = sorted(
        (n for n in snap if n.startswith(f"{ple_base}.shard_")), key=lambda n: int(n.split("_")[-1][:-7])
    )
    table = torch.cat([e4m3_to_float(snap[n]) for n in shards]) * snap[f"{ple_base}.weight_scale"].float()
    resident = {
        n.removeprefix(PREFIX): t for n, t in snap.items() if n.startswith(PREFIX) and ".experts." not in n
    }
    resident["lm_head.weight"] = snap["lm_head.weight"]
    # matrices the workdir keeps as FP8 rows: the reference uses their exact dequantization
    stored = engine.workdir.load_resident(sorted(engine.workdir.fp8_row_scaled))
    for n in engine.workdir.fp8_row_scaled:
        resident[n] = dequantize_fp8_rows(stored[n], stored[f"{n}_scale"])
    return Qwen4ExpModel(args, resident, DenseExperts(gate_up, down), DenseTable(table))


def engine_for(workdir, control="none", **kw) -> Engine:
    cfg = EngineConfig(
        model=str(workdir),
        device="cpu",
        dtype="float32",
        max_model_len=256,
        ram_cache_gb=0.001,
        io_threads=2,
        **kw,
    )
    return Engine(cfg, control=control)


def prompt(engine: Engine) -> torch.Tensor:
    ids = torch.randint(0, engine.args.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3))
    ids[[20, 60]] = engine.args.eos_id
    return ids


@pytest.fixture(scope="module")
def fp8_workdir(tiny_snapshot, tmp_path_factory):
    return setup_workdir(
        tiny_snapshot, tmp_path_factory.mktemp("work") / "fp8", fp8_dense=True, progress=False
    )


@pytest.fixture(scope="module")
def engine(tiny_workdir):
    e = engine_for(tiny_workdir)
    yield e
    e.close()


@pytest.mark.parametrize("which", ["bf16", "fp8"])
def test_engine_equals_reference_from_snapshot(which, engine, fp8_workdir, tiny_snapshot):
    eng = engine if which == "bf16" else engine_for(fp8_workdir)
    assert which == "bf16" or eng.workdir.fp8_row_scaled
    ids = torch.cat((prompt(eng), prompt(eng)[:5]))
    st = eng.new_state()
    # prompt in two calls (store bypass, chunked GDN), then single tokens (cached store path, recurrent GDN)
    rows = [eng.forward(st, ids[:90], all_logits=True), eng.forward(st, ids[90:PROMPT], all_logits=True)]
    rows += [eng.forward(st, [t])[None] for t in ids[PROMPT:].tolist()]
    got = torch.cat(rows)
    assert got.shape == (PROMPT + 5, eng.args.vocab_size) and got.isfinite().all()
    ref_model = reference_model(tiny_snapshot, eng)
    ref = ref_model.logits(ref_model(ids, State(eng.args, 256, torch.float32, "cpu")))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    stats = eng.stats()
    assert stats.misses > 0 and stats.bytes_read > 0 and stats.ple_bytes_read > 0
    if eng is not engine:
        eng.close()


@pytest.mark.parametrize("control", ["swap-nibbles", "no-experts"])
def test_must_break_controls_change_the_logits(control, engine, tiny_workdir):
    ids = prompt(engine)
    good = engine.forward(engine.new_state(), ids, all_logits=True)
    broken_engine = engine_for(tiny_workdir, control=control)
    broken = broken_engine.forward(broken_engine.new_state(), ids, all_logits=True)
    broken_engine.close()
    assert (broken - good).abs().max() > 0.05 * good.abs().max()
    if control == "no-experts":
        assert broken_engine.stats().requests == 0


def test_last_logits_and_errors(engine):
    ids = prompt(engine)
    st = engine.new_state()
    last = engine.forward(st, ids[:10])
    assert last.shape == (engine.args.vocab_size,) and last.dtype == torch.float32
    with pytest.raises(ValueError, match="max_model_len"):
        engine.forward(st, torch.zeros(250, dtype=torch.long))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.forward(st, [engine.args.vocab_size])
    with pytest.raises(ValueError, match="at least one"):
        engine.forward(st, [])
    assert st.pos == 10  # refused calls leave the state untouched


def test_max_model_len_is_clamped_to_the_config(tiny_workdir):
    big = Engine(EngineConfig(model=str(tiny_workdir), device="cpu", max_model_len=10**7, ram_cache_gb=0.001))
    assert big.config.max_model_len == big.args.max_position_embeddings
    assert big.dtype == torch.float32
    big.close()


def test_layer_major_spans_equal_the_piece_by_piece_forward(engine):
    """A span of several pieces runs layer by layer (each layer's experts once over the span) and equals the
    same prompt fed piece by piece, logits and state; the bank sees one call per layer and span."""
    ids = prompt(engine)  # PROMPT tokens, two EOS inside
    calls = []

    def counting(layer, x, *a):
        calls.append((layer, x.shape[0]))
        return engine.bank(layer, x, *a)

    try:
        engine.set_prefill(9, 9)  # piece-major: every 9-token piece through every layer
        st_a = engine.new_state()
        want = engine.forward(st_a, ids, all_logits=True)
        engine.set_prefill(9, 45)  # layer-major: spans of 45 tokens, attention in 9-token pieces
        st_b = engine.new_state()
        for layer in engine.model.layers:
            layer.mlp.bank = counting
        direct = []  # PLE rows the pieces read themselves: none, the span read them all ahead
        engine.ple._read_now = lambda r: direct.append(r) or PleTable._read_now(engine.ple, r)
        got = engine.forward(st_b, ids, all_logits=True)
    finally:
        for layer in engine.model.layers:
            layer.mlp.bank = engine.bank
        del engine.ple._read_now
        engine.set_prefill(min(8192, engine.config.max_model_len), engine.config.max_model_len)
    assert engine.args.ple_layers and direct == []
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert st_a.pos == st_b.pos == PROMPT and st_a.tokens == st_b.tokens
    assert torch.equal(st_a.ple_ctx, st_b.ple_ctx)
    snap_a, snap_b = st_a.snapshot(), st_b.snapshot()  # every state tensor, as far as it is filled
    assert snap_a.tensors.keys() == snap_b.tensors.keys()
    for name, t in snap_a.tensors.items():
        torch.testing.assert_close(snap_b.tensors[name], t, rtol=1e-4, atol=1e-4, msg=name)
    spans = -(-PROMPT // 45)
    assert len(calls) == spans * engine.args.num_hidden_layers
    assert sorted({n for _, n in calls}) == sorted({min(45, PROMPT - a) for a in range(0, PROMPT, 45)})
    # decoding on from either state gives the same next logits
    torch.testing.assert_close(engine.forward(st_b, [5]), engine.forward(st_a, [5]), rtol=1e-4, atol=1e-4)


def test_set_prefill_refuses_a_span_shorter_than_its_piece(engine):
    with pytest.raises(ValueError, match="piece <= span"):
        engine.set_prefill(64, 32)


def test_prefill_flags_override_the_plan_and_are_checked(tiny_workdir):
    with pytest.raises(ValueError, match="shorter than prefill_piece"):
        EngineConfig(model=str(tiny_workdir), prefill_piece=64, prefill_span=32)
    with pytest.raises(ValueError, match="prefill_piece must be positive"):
        EngineConfig(model=str(tiny_workdir), prefill_piece=0)
    eng = engine_for(tiny_workdir, prefill_span=48)  # the piece follows a span shorter than it
    assert (eng.prefill_piece, eng.prefill_span) == (48, 48)
    eng.close()
    eng = engine_for(tiny_workdir, prefill_piece=16)
    assert (eng.prefill_piece, eng.prefill_span) == (16, 256)  # the CPU span: the whole context
    eng.close()
