"""Device check: every kernel in BF16 against its FP32 `_ref` twin on real shapes (the expert kernels in
NVFP4 at Qwen3.8-Flash-Next's dims and in MXFP4 at DeepSeek-V4-Flash's, the FP8 matmul row-scaled and with
DeepSeek-V4-Flash's 128x128 UE8M0 blocks); exits 1 past tolerance.

Run from the repo root on a CUDA machine: `python3 scripts/device_kernel_check.py`.
Tolerances (docs/kernels.md): relative error ||got - ref|| / ||ref|| <= 1e-2 and max abs error
<= 2e-2 * max|ref|; BF16 rounding of x, h, per-pair outputs and the result gives about 3e-3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from expertstream.bench.kernels import (  # noqa: E402
    EXPERTS,
    FP8_M,
    FP8_SHAPES,
    GDN_HEADS,
    HIDDEN,
    TOPK,
    gdn_inputs,
    random_bank,
    route,
)
from expertstream.kernels import (  # noqa: E402
    fp8_block_matmul,
    fp8_block_matmul_ref,
    fp8_rows_matmul,
    fp8_rows_matmul_ref,
    gdn_step,
    gdn_step_ref,
    nvfp4_moe_decode,
    nvfp4_moe_decode_ref,
    nvfp4_moe_prefill,
    nvfp4_moe_prefill_ref,
)

REL_TOL, MAX_TOL = 1e-2, 2e-2
NUM_SLOTS = 64
PREFILL_T = (1, 32, 512, 2451)


def compare(name: str, got: torch.Tensor, ref: torch.Tensor) -> bool:
    err = (got.float() - ref.float()).abs()
    rel = (err.norm() / ref.float().norm()).item()
    max_rel = (err.max() / ref.float().abs().max()).item()
    ok = rel <= REL_TOL and max_rel <= MAX_TOL and bool(torch.isfinite(got).all())
    print(
        f"{'ok  ' if ok else 'FAIL'} {name:42s} max abs {err.max().item():.3e}  "
        f"mean abs {err.mean().item():.3e}  rel {rel:.3e}  max/max|ref| {max_rel:.3e}",
        flush=True,
    )
    return ok


def check_mxfp4() -> bool:
    """The expert kernels on MXFP4 blocks at DeepSeek-V4-Flash's dims (synth's ds4-full-shape preset), with
    its SwiGLU clamp: decode from slots and from pinned host rows (bit for bit the same), prefill."""
    from expertstream.formats.expert_block import ExpertLayout
    from expertstream.synth.deepseek_v4 import preset_dims

    d = preset_dims("ds4-full-shape")
    h, i, k, e = d["hidden_size"], d["moe_intermediate_size"], d["num_experts_per_tok"], d["n_routed_experts"]
    lim = d["swiglu_limit"]
    layout, slots, ws2 = random_bank(32, seed=2, layout=ExpertLayout.for_format("mxfp4", h, i))
    e2s = torch.randint(0, 32, (e,), dtype=torch.int32, device="cuda")
    ok, name = True, f"MXFP4 H={h} I={i}"
    ids, w = route(1, num_experts=e, k=k, seed=2)
    x = torch.randn(h, device="cuda").bfloat16()
    scales = ws2[e2s.long()].contiguous()
    for limit in (lim, None):
        got = nvfp4_moe_decode(x, ids[0], e2s, scales, w[0], layout, slots, swiglu_limit=limit)
        ref = nvfp4_moe_decode_ref(x.float(), ids[0], e2s, scales, w[0], layout, slots, swiglu_limit=limit)
        ok &= compare(f"decode {name} k={k} limit {limit}", got, ref)
    host = slots.cpu().pin_memory()
    got_host = nvfp4_moe_decode(x, ids[0], -1 - e2s, scales, w[0], layout, slots, host, swiglu_limit=lim)
    bits = torch.equal(
        got_host, nvfp4_moe_decode(x, ids[0], e2s, scales, w[0], layout, slots, swiglu_limit=lim)
    )
    print(
        f"{'ok  ' if bits else 'FAIL'} decode {name} from host RAM bit for bit the one from slots", flush=True
    )
    ok &= bits
    for t in (1, 32, 512):
        ids, w = route(t, num_experts=e, k=k, seed=t + 2)
        x = torch.randn(t, h, device="cuda").bfloat16()
        got = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, swiglu_limit=lim)
        ref = nvfp4_moe_prefill_ref(x.float(), slots, ids, e2s, ws2, w, layout, swiglu_limit=lim)
        ok &= compare(f"prefill {name} T={t} limit {lim}", got, ref)
    return ok


def check_fp8_blocks() -> bool:
    """The block-scaled FP8 matmul on DeepSeek-V4-Flash's dense matrices (ds4-full-shape dims), UE8M0 scales
    per 128x128 block, decode (M = 1, 4) and prompt (M = 64, 512) rows; M = 1 timed (weight bytes / s)."""
    from expertstream.synth.deepseek_v4 import preset_dims

    d = preset_dims("ds4-full-shape")
    h, q, nh, hd = d["hidden_size"], d["q_lora_rank"], d["num_attention_heads"], d["head_dim"]
    g, r, i = d["o_groups"], d["o_lora_rank"], d["moe_intermediate_size"]
    ih, idim = d["index_n_heads"], d["index_head_dim"]
    shapes = {  # name: [N, K]
        "wq_a": (q, h), "wq_b": (nh * hd, q), "wkv": (hd, h), "wo_a group": (r, nh * hd // g),
        "wo_b": (h, g * r), "indexer wq_b": (ih * idim, q), "shared w1": (i, h), "shared w2": (h, i),
    }  # fmt: skip
    ok = True
    for name, (n, k) in shapes.items():
        w = torch.randint(0, 255, (n, k), dtype=torch.uint8, device="cuda")
        w[(w & 0x7F) == 0x7F] = 0
        w = w.view(torch.float8_e4m3fn)
        scale = torch.randint(110, 122, (-(-n // 128), -(-k // 128)), dtype=torch.uint8, device="cuda")
        scale = scale.view(torch.float8_e8m0fnu)
        for m in (1, 4, 64, 512):
            x = torch.randn(m, k, device="cuda").bfloat16()
            got = fp8_block_matmul(x, w, scale, (128, 128))
            ref = fp8_block_matmul_ref(x.float(), w, scale, (128, 128))
            ok &= compare(f"fp8_block_matmul {name} M={m} N={n} K={k}", got, ref)
        x = torch.randn(1, k, device="cuda").bfloat16()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(100):
            fp8_block_matmul(x, w, scale, (128, 128))
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 10  # ms for 100 -> us each
        print(
            f"     fp8_block_matmul {name} M=1: {us:.1f} us, {n * k / us / 1e3:.0f} GB/s of weights",
            flush=True,
        )
    return ok


def main() -> int:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    print(torch.cuda.get_device_name(), torch.cuda.get_device_capability(), flush=True)
    layout, slots, ws2 = random_bank(NUM_SLOTS, seed=1)
    e2s = torch.randint(0, NUM_SLOTS, (EXPERTS,), dtype=torch.int32, device="cuda")
    ok = True

    ids, w = route(1, seed=1)
    x = torch.randn(HIDDEN, device="cuda").bfloat16()
    loc, scales = e2s, ws2[e2s.long()].contiguous()  # expert e's block in slot e2s[e]
    got = nvfp4_moe_decode(x, ids[0], loc, scales, w[0], layout, slots)
    ok &= compare(
        f"nvfp4_moe_decode k={TOPK}", got,
        nvfp4_moe_decode_ref(x.float(), ids[0], loc, scales, w[0], layout, slots),
    )  # fmt: skip
    # the same experts read from pinned host RAM over the bus
    host = slots.cpu().pin_memory()
    got_host = nvfp4_moe_decode(x, ids[0], -1 - loc, scales, w[0], layout, slots, host)
    ok &= compare(f"nvfp4_moe_decode k={TOPK}, blocks in host RAM", got_host, got.float())
    host_bits = torch.equal(got_host, got)  # one launch shape wherever the blocks are: the same sums
    print(f"{'ok  ' if host_bits else 'FAIL'} nvfp4_moe_decode from host RAM bit for bit the one from slots")
    ok &= host_bits
    same = all(
        torch.equal(got, nvfp4_moe_decode(x, ids[0], loc, scales, w[0], layout, slots)) for _ in range(5)
    )
    print(
        f"{'ok  ' if same else 'FAIL'} nvfp4_moe_decode bitwise equal over 6 calls (fixed-order sum)",
        flush=True,
    )
    ok &= same
    # staging guesses from pinned RAM rows to VRAM rows: bytes and the working location row exact
    from expertstream.kernels.stage_blocks import stage_blocks, stage_blocks_ref

    guess, base = ids[0][:4].contiguous(), -1 - loc  # every expert in host row e2s[e]
    rows = torch.zeros(8, slots.shape[1], dtype=torch.uint8, device="cuda")
    rows_ref = rows.clone()
    work, work_ref = torch.empty_like(base), torch.empty_like(base)
    stage_blocks(guess, base, host, rows, 4, work)
    stage_blocks_ref(guess, base, host, rows_ref, 4, work_ref)
    exact = torch.equal(rows, rows_ref) and torch.equal(work, work_ref)
    print(f"{'ok  ' if exact else 'FAIL'} stage_blocks G=4: staged bytes and location row exact", flush=True)
    ok &= exact

    for t in PREFILL_T:
        ids, w = route(t, seed=t)
        x = torch.randn(t, HIDDEN, device="cuda").bfloat16()
        got = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout)
        ref = nvfp4_moe_prefill_ref(x.float(), slots, ids, e2s, ws2, w, layout)
        ok &= compare(f"nvfp4_moe_prefill T={t}", got, ref)

    ok &= check_mxfp4()
    ok &= check_fp8_blocks()

    for n, k in FP8_SHAPES:
        q = torch.randint(0, 255, (n, k), dtype=torch.uint8, device="cuda")
        q[(q & 0x7F) == 0x7F] = 0  # no NaN bytes
        q = q.view(torch.float8_e4m3fn)
        scale = torch.rand(n, device="cuda") / 448
        for m in FP8_M:
            x = torch.randn(m, k, device="cuda").bfloat16()
            got = fp8_rows_matmul(x, q, scale)
            ok &= compare(f"fp8_rows_matmul M={m} N={n} K={k}", got, fp8_rows_matmul_ref(x.float(), q, scale))
    step = gdn_inputs()
    ref_state, state = step[4].clone(), step[4].clone()
    kw = dict(num_k_heads=GDN_HEADS[0], eps=1e-6, gate="silu")
    want = gdn_step_ref(*step[:4], ref_state, *step[5:], **kw)
    got = gdn_step(*step[:4], state, *step[5:], **kw)
    ok &= compare("gdn_step Hv=48 Dk=Dv=128 (output)", got, want)
    ok &= compare("gdn_step Hv=48 Dk=Dv=128 (state)", state, ref_state)
    print("PASS" if ok else "FAIL: errors above the documented BF16 tolerances", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
