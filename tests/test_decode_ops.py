"""The decode path's small-op kernels (router top-k, RMSNorm, hyper-connection mix and MoE combine, the GDN
conv step) against their plain-torch twins, under the interpreter on the CPU (fp32, fp16) or on CUDA, and the
model's dispatch between kernel and twin."""

import dataclasses

import pytest
import torch

from expertstream.kernels import conv_update, hyper, rms_norm, router
from expertstream.kernels.dispatch import Fused

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
# one rounding step of the dtype: the kernels and the twins round at the same points, in another order
ULP = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def close(got, want, dtype):
    tol = ULP[dtype]
    torch.testing.assert_close(
        got.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item()
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, e, k", [(1, 64, 10), (3, 100, 1), (2, 512, 10), (1, 37, 37)])
@pytest.mark.parametrize("renormalise", [True, False])
def test_route_topk_equals_the_torch_router(dtype, t, e, k, renormalise):
    logits = rand(t, e, dtype=dtype, seed=e + k, scale=3.0)
    ids, w = router.route_topk(logits, k, renormalise)
    want_ids, want_w = router.route_topk_ref(logits, k, renormalise)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (t, k)
    # the same logits best first (16-bit logits tie, and a tie may come in either order), each expert once
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    assert all(len(set(row)) == k for row in ids.tolist())
    if dtype == torch.float32:  # no ties: the same experts in the same order
        assert torch.equal(ids, want_ids)
    close(w, want_w, dtype)
    top = router.top_ids(logits, k)
    assert torch.equal(logits.gather(1, top), logits.gather(1, router.top_ids_ref(logits, k)))


def test_route_topk_breaks_ties_towards_the_lower_id_and_renormalises():
    logits = torch.zeros(2, 16, device=DEV)
    logits[1, 5] = logits[1, 9] = 1.0
    ids, w = router.route_topk(logits, 4, True)
    assert ids.tolist() == [[0, 1, 2, 3], [5, 9, 0, 1]]
    torch.testing.assert_close(w.sum(-1), torch.ones(2, device=DEV))
    _, raw = router.route_topk(logits, 4, False)  # the control: without renormalising they sum below 1
    assert (raw.sum(-1) < 0.9).all()


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's numpy max over the NaN row
def test_route_topk_keeps_the_ids_of_a_nan_row_in_range():
    """A broken row (NaN logits) must not send the expert kernels an id past the experts."""
    logits = torch.zeros(2, 12, device=DEV)
    logits[1, 3] = float("nan")
    ids, _ = router.route_topk(logits, 4, True)
    assert ids.min() >= 0 and ids.max() < 12
    assert ids[0].tolist() == [0, 1, 2, 3]  # the healthy row as before


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape, group", [((1, 40), None), ((3, 40), 10), ((2, 4 * 48), 48), ((1, 2560), None)]
)
def test_rms_norm_equals_the_torch_form(dtype, shape, group):
    x = rand(*shape, dtype=dtype, seed=shape[1], scale=4.0)
    scale = 1.0 + rand(shape[1], seed=1, scale=0.1)
    got = rms_norm.rms_norm(x, scale, 1e-6, group)
    assert got.dtype == dtype and got.shape == x.shape
    close(got, rms_norm.rms_norm_ref(x, scale, 1e-6, group), dtype)
    if group:  # the control: one norm over the whole row is another result
        with pytest.raises(AssertionError):
            close(got, rms_norm.rms_norm_ref(x, scale, 1e-6, None), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, n, h", [(1, 4, 40), (2, 4, 1100), (1, 2, 8), (2, 3, 20)])
@pytest.mark.parametrize("with_inj", [True, False])
def test_hc_mix_equals_the_torch_form(dtype, t, n, h, with_inj):
    mix, xn = rand(t, n * h, dtype=dtype, seed=1, scale=2.0), rand(t, n * h, dtype=dtype, seed=2)
    proj = rand(t, 7 + n, dtype=dtype, seed=3)  # the injection logits are a strided split of a wider output
    inj = proj[:, 7:] if with_inj else None
    u, c = hyper.hc_mix(mix, xn, inj, n)
    want_u, want_c = hyper.hc_mix_ref(mix, xn, inj, n)
    assert u.shape == (t, h) and u.dtype == dtype
    close(u, want_u, dtype)
    if with_inj:
        close(c, want_c, dtype)
    else:
        assert c is None and want_c is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routed_fp32", [True, False])
@pytest.mark.parametrize("in_place", [True, False])
def test_moe_combine_equals_the_torch_form(dtype, routed_fp32, in_place):
    t, n, h = 2, 4, 1030
    x, c = rand(t, n * h, dtype=dtype, seed=4), torch.sigmoid(rand(t, n, dtype=dtype, seed=5))
    routed = rand(t, h, dtype=torch.float32 if routed_fp32 else dtype, seed=6)
    gate, shared = torch.sigmoid(rand(t, 1, dtype=dtype, seed=7)), rand(t, h, dtype=dtype, seed=8)
    want = hyper.moe_combine_ref(x.clone(), c, routed, gate, shared)
    x_in = x.clone()
    got = hyper.moe_combine(x_in, c, routed, gate, shared, in_place)
    close(got, want, dtype)
    assert (got.data_ptr() == x_in.data_ptr()) == in_place
    if not in_place:
        assert torch.equal(x_in, x)  # the input streams untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [4, 2, 1])
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_conv_update_equals_the_torch_form_and_shifts_the_history(dtype, k, act):
    c = 1100
    hist, new = rand(k - 1, c, dtype=dtype, seed=9), rand(1, c, dtype=dtype, seed=10)
    w_t = rand(k, c, seed=11, scale=0.5)
    hist_ref = hist.clone()
    want = conv_update.conv_update_ref(hist_ref, new, w_t, act)
    got = conv_update.conv_update(hist, new, w_t, act)
    assert got.dtype == torch.float32 and got.shape == (1, c)
    close(got, want, dtype)
    assert torch.equal(hist, hist_ref)  # the same rows, moved: no arithmetic on the history
    if k > 1:
        assert torch.equal(hist[-1], new[0])


def test_fused_dispatch_uses_the_kernel_then_falls_back_once(caplog):
    calls = []

    def kernel(x):
        calls.append(1)
        return x + 1

    op = Fused(kernel, lambda x: x + 1, "test op")
    x = torch.zeros(3, device=DEV)
    assert torch.equal(op(x, kernel=False), x + 1) and calls == []  # the twin
    op(x, kernel=True)
    assert calls == [1]  # CUDA, or the interpreter standing in for it

    def broken(x):
        calls.append(2)
        raise RuntimeError("no such instruction")

    op = Fused(broken, lambda x: x + 1, "test op")
    assert torch.equal(op(x, kernel=True), x + 1) and "test op kernel failed" in caplog.text
    assert torch.equal(op(x, kernel=True), x + 1) and calls == [1, 2]  # failed once: the twin from then on


def test_the_model_runs_every_fused_kernel_and_matches_the_twins(tiny_workdir, caplog):
    """The tiny model's prompt and decode steps with the kernels (`kernels="triton"`; the interpreter on the
    CPU) against the twins (`kernels="torch"`), in FP32: the same greedy tokens, logits within FP32 noise,
    and no kernel fell back. Eager: the calls are counted outside any graph."""
    from expertstream.config import EngineConfig
    from expertstream.models import base
    from expertstream.runtime.engine import Engine

    def run(kernels: str):
        cfg = EngineConfig(model=str(tiny_workdir), device=DEV, dtype="float32", enforce_eager=True)
        eng = Engine(dataclasses.replace(cfg, kernels=kernels))
        st = eng.new_state()
        rows = [eng.forward(st, [3, 14, 15, 92, 65])]
        for _ in range(3):
            rows.append(eng.forward(st, [int(rows[-1].argmax())]))
        eng.close()
        return torch.stack(rows)

    calls = {op.what: 0 for op in base.FUSED}
    kernels = {op.what: op.kernel for op in base.FUSED}
    for op in base.FUSED:
        op.kernel = lambda *a, op=op, **k: (
            calls.__setitem__(op.what, calls[op.what] + 1) or kernels[op.what](*a, **k)
        )
    try:
        want = run("torch")
        assert not any(calls.values()), calls  # the twins only
        got = run("triton")
    finally:
        for op in base.FUSED:
            op.kernel = kernels[op.what]
    assert "kernel failed" not in caplog.text
    assert all(calls.values()), calls  # every fused op ran as a kernel
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
