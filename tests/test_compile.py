"""Every Triton kernel compiled to a cubin for Hopper (sm_90) and Blackwell (sm_120) on this CPU box, with the
real model's shapes: a construct the interpreter runs but the GPU compiler refuses (two return types, a
tuple it cannot index) fails CI instead of a GPU run. Compiling is not running: device runs check results.
The compiles run in a fresh process without TRITON_INTERPRET (the test session's kernels are interpreted)."""

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - another Triton layout
    pytest.skip("this Triton has no ASTSource / GPUTarget", allow_module_level=True)

from expertstream.kernels import (  # noqa: E402
    conv_update,
    decode_counts,
    fp8_gemv,
    gdn_decode,
    hyper,
    nvfp4_moe,
    rms_norm,
    router,
    stage_blocks,
    stream_read,
)

H, I, K = 2560, 640, 10  # hidden, expert width, experts per token of the real model
# the expert kernels' formats at their models' dims: NVFP4 (Qwen3.8-Flash-Next), MXFP4 (DeepSeek-V4-Flash,
# with its SwiGLU clamp)
FORMATS = ((False, H, I, K), (True, 4096, 2048, 6))
# what Triton's launch-time specialisation tells the compiler: pointers and these integers (sizes and byte
# offsets of the real model's blocks) are multiples of 16, so loads vectorise as they do on the GPU
DIV16 = {"block_bytes", "H", "I", "N", "gw_off", "uw_off", "gs_off", "us_off", "dw_off", "ds_off"}

BLOCK = dict(slots_ptr="*u8", block_bytes="i32")
DECODE_IN = dict(ids_ptr="*i64", loc_ptr="*i32", scales_ptr="*fp32", host_ptr="*u8", **BLOCK)
TILES = dict(pair_ptr="*i32", tile_expert_ptr="*i32", e2s_ptr="*i32", ws2_ptr="*fp32", P="i32", T0="i32")


def kernels(cap: int) -> list[tuple[str, object, dict, dict, int]]:
    """(name, kernel, argument types, constexprs, num_warps) of every kernel in every form cap selects."""
    ptx = (False, True) if cap >= 100 else (False,)
    out = []
    for p, (mx, h, i, k) in ((p, f) for p in ptx for f in FORMATS):
        fmt = " mxfp4" if mx else ""
        out.append(
            (
                "decode gate+up" + fmt,
                nvfp4_moe._decode_gate_up_kernel,
                dict(
                    x_ptr="*bf16",
                    h_ptr="*fp32",
                    gw_off="i32",
                    uw_off="i32",
                    gs_off="i32",
                    us_off="i32",
                    limit="fp32",
                    **DECODE_IN,
                ),
                dict(H=h, I=i, BLOCK_N=4, BLOCK_G=32 // (1 + mx), PDL=True, USE_PTX=p, MXFP4=mx, CLAMP=mx),
                2,
            )
        )
        out.append(
            (
                "decode down" + fmt,
                nvfp4_moe._decode_down_kernel,
                dict(
                    h_ptr="*fp32",
                    w_ptr="*fp32",
                    part_ptr="*fp32",
                    done_ptr="*i32",
                    out_ptr="*bf16",
                    dw_off="i32",
                    ds_off="i32",
                    **DECODE_IN,
                ),
                dict(
                    K=k,
                    PER=1,
                    H=h,
                    I=i,
                    BLOCK_N=16,
                    BLOCK_G=8 // (1 + mx),
                    PDL=True,
                    USE_PTX=p,
                    LINES_W=nvfp4_moe.prefetch_lines(i // 2),
                    LINES_S=nvfp4_moe.prefetch_lines(i // (16 << mx)),
                    MXFP4=mx,
                ),  # fmt: skip
                2,
            )
        )
        tiles = dict(
            BLOCK_M=64,
            BLOCK_N=64,
            BLOCK_K=64,
            DOT_PRECISION="tf32",
            USE_PTX=p,
            SCALE_WORDS=False,
            TILE_MAJOR=False,
            MXFP4=mx,
        )
        out.append(
            (
                "prefill gate+up" + fmt,
                nvfp4_moe._prefill_gate_up_kernel,
                dict(
                    x_ptr="*bf16",
                    h_ptr="*bf16",
                    K="i32",
                    H="i32",
                    I="i32",
                    gw_off="i32",
                    uw_off="i32",
                    gs_off="i32",
                    us_off="i32",
                    limit="fp32",
                    **TILES,
                    **BLOCK,
                ),
                {**tiles, "CLAMP": mx},
                4,
            )
        )
        out.append(
            (
                "prefill down" + fmt,
                nvfp4_moe._prefill_down_kernel,
                dict(
                    h_ptr="*bf16",
                    w_ptr="*fp32",
                    y_ptr="*bf16",
                    H="i32",
                    I="i32",
                    dw_off="i32",
                    ds_off="i32",
                    **TILES,
                    **BLOCK,
                ),
                tiles,
                4,
            )
        )
        # the same two launches reading the block scales as int32 words, then also in tile-major order
        out += [
            (name + suffix, fn, types, {**c, "SCALE_WORDS": True, "TILE_MAJOR": major}, nw)
            for name, fn, types, c, nw in out[-2:]
            for suffix, major in ((" words", False), (" words tile-major", True))
        ]
    out.append(
        (
            "combine rows",
            nvfp4_moe._combine_rows_kernel,
            dict(
                y_ptr="*bf16",
                row_ptr="*i32",
                tile_expert_ptr="*i32",
                e2s_ptr="*i32",
                total_ptr="*fp32",
                T="i32",
                K="i32",
                R0="i32",
                R1="i32",
                H="i32",
            ),
            dict(ACCUMULATE=True, BLOCK_M=64, BLOCK_T=16, BLOCK_N=128),
            4,
        )
    )
    fp8 = dict(x_ptr="*bf16", scale_ptr="*fp32", out_ptr="*bf16", M="i32", N="i32")
    gemv = dict(K=H, K_SPLIT=H, BLOCK_M=1, BLOCK_N=16, BLOCK_K=512, PDL=True, AHEAD=H)
    rows = dict(SCALE_N=1, SCALE_K=0, E8M0=False)  # one FP32 scale a row
    ue8m0 = dict(SCALE_N=128, SCALE_K=128, E8M0=True)  # DeepSeek-V4's 128 x 128 UE8M0 blocks
    # 16-bit weights (matvec16): the GEMV without decode or scale
    wide = dict(fp8, q_ptr="*bf16", scale_ptr="*bf16")
    lines, lines8 = fp8_gemv.prefetch_lines(2 * H), fp8_gemv.prefetch_lines(H)
    out.append(
        (
            "matvec16",
            fp8_gemv._fp8_gemv_kernel,
            wide,
            dict(gemv, **rows, UNIT=1.0, NATIVE=False, WIDE=True, WORDS=False, AHEAD=2 * H, LINES=lines),
            4,
        )
    )
    for native in (False, True):  # raw bytes decoded with bit ops; float8e4nv loads (sm_89+: both caps here)
        unit = 1.0 if native else 256.0
        for form, scales, types in (("rows", rows, fp8), ("ue8m0 blocks", ue8m0, dict(fp8, scale_ptr="*u8"))):
            suffix = f" {form}" + (" native" if native else "")
            out.append(
                (
                    "fp8 dot" + suffix,
                    fp8_gemv._fp8_dot_kernel,
                    dict(q_ptr="*fp8e4nv" if native else "*u8", K="i32", **types),
                    dict(
                        scales,
                        UNIT=unit,
                        NATIVE=native,
                        BLOCK_M=64,
                        BLOCK_N=64,
                        BLOCK_K=64,
                        DOT_PRECISION="tf32",
                    ),  # fmt: skip
                    4,
                )
            )
            step = dict(BLOCK_N=16, BLOCK_K=128) if scales["SCALE_K"] else {}
            out.append(
                (
                    "fp8 gemv" + suffix,
                    fp8_gemv._fp8_gemv_kernel,
                    dict(q_ptr="*fp8e4nv" if native else "*i32", **types),
                    dict(
                        gemv,
                        **scales,
                        **step,
                        UNIT=unit,
                        NATIVE=native,
                        WIDE=False,
                        WORDS=not native,
                        LINES=lines8,
                    ),  # fmt: skip
                    4,
                )
            )
    act = {n: "*bf16" for n in ("b_ptr", "a_ptr", "z_ptr", "dtb_ptr", "nw_ptr", "out_ptr")}
    out.append(
        (
            "gdn step",
            gdn_decode._gdn_step_kernel,
            dict(qkv_ptr="*fp32", s_ptr="*fp32", nega_ptr="*fp32", eps="fp32", q_scale="fp32", **act),
            dict(HK=16, HV=48, DK=128, DV=128, SILU=True, PDL=True),
            8,
        )
    )
    hc, ne = 4, 512  # hyper-connection streams and experts of the real model
    out += [
        (
            "router top-k",
            router._route_kernel,
            dict(x_ptr="*bf16", ids_ptr="*i64", w_ptr="*fp32", stride="i32", E="i32"),
            dict(K=K, KP=16, BLOCK=ne, SOFTMAX=softmax, RENORM=True),
            4,
        )
        for softmax in (True, False)
    ]
    out += [
        (
            "rms norm",
            rms_norm._rms_norm_kernel,
            dict(x_ptr="*bf16", w_ptr="*fp32", out_ptr="*bf16", n_groups="i32", eps="fp32"),
            dict(G=H, BLOCK=4096),
            8,
        ),
        (
            "hc mix",
            hyper._hc_mix_kernel,
            dict(
                mix_ptr="*bf16",
                xn_ptr="*bf16",
                u_ptr="*bf16",
                inj_ptr="*bf16",
                c_ptr="*bf16",
                inj_stride="i32",
                H="i32",
            ),  # fmt: skip
            dict(N=hc, NP=hc, INJ=True, BLOCK=hyper.BLOCK_H, PDL=True),
            4,
        ),
        (
            "moe combine",
            hyper._moe_combine_kernel,
            dict(
                x_ptr="*bf16",
                c_ptr="*bf16",
                r_ptr="*fp32",
                g_ptr="*bf16",
                s_ptr="*bf16",
                out_ptr="*bf16",
                H="i32",
                g_stride="i32",
            ),  # fmt: skip
            dict(N=hc, BLOCK=hyper.BLOCK_H),
            4,
        ),
        (
            "gdn conv",
            conv_update._conv_update_kernel,
            dict(hist_ptr="*bf16", new_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32", C="i32"),
            dict(K=4, SILU=True, BLOCK=conv_update.BLOCK_C),
            4,
        ),
    ]
    out.append(
        (
            "stage blocks",
            stage_blocks._stage_kernel,
            dict(
                ids_ptr="*i64",
                loc_ptr="*i32",
                host_ptr="*u8",
                slots_ptr="*u8",
                out_loc_ptr="*i32",
                count_ptr="*i64",
                first="i32",
                block_bytes="i32",
                steps="i32",
            ),
            dict(CHUNK=stage_blocks.CHUNK, COUNT=True),
            4,
        )
    )
    out.append(
        (
            "stream read",
            stream_read._read_kernel,
            dict(rows_ptr="*u8", ids_ptr="*i64", out_ptr="*i32", row_words="i32", n_words="i32"),
            dict(W=stream_read.PIECE // 4),
            4,
        )
    )
    out.append(
        (
            "decode counts",
            decode_counts._counts_kernel,
            dict(
                ids_ptr="*i64",
                loc_ptr="*i32",
                counts_ptr="*i64",
                hot_ptr="*i64",
                staged_ptr="*i64",
                hits_ptr="*i64",
                K="i32",
                G="i32",
            ),
            dict(BK=16, BG=4, HOT=True, STAGED=True),
            1,
        )
    )
    out.append(
        (
            "copy rows",
            stage_blocks._copy_rows_kernel,
            dict(pairs_ptr="*i32", host_ptr="*u8", slots_ptr="*u8", block_bytes="i32", steps="i32"),
            dict(CHUNK=stage_blocks.CHUNK),
            4,
        )
    )
    return out


def compile_all(cap: int, registers: bool = False) -> list[str]:
    """Compile every kernel for sm_<cap>; the failures, one line each. `registers`: also print each kernel's
    registers and spills as the bundled ptxas reports them (`python tests/test_compile.py 90 --registers`)."""
    failed = []
    for name, fn, types, consts, warps in kernels(cap):
        names = fn.arg_names
        assert set(types) | set(consts) == set(names), f"{name}: signature {sorted(set(names) ^ set(types))}"
        div = [n for n, t in types.items() if t.startswith("*") or n in DIV16]
        src = ASTSource(
            fn,
            {n: "constexpr" if n in consts else types[n] for n in names},
            constexprs={(names.index(n),): v for n, v in consts.items()},
            attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div},
        )
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": warps})
            assert compiled.asm.get("cubin"), "no cubin"
        except Exception as e:  # every failure listed, not only the first
            failed.append(f"{name} {consts}: {type(e).__name__} {str(e)[-400:]}")
            continue
        if registers:
            print(f"{name} {consts}: {ptxas_resources(compiled.asm['ptx'], cap)}")
    return failed


def ptxas_resources(ptx: str, cap: int) -> str:
    """ptxas -v's register and spill lines for one kernel's PTX (the ptxas Triton ships and uses)."""
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        arch = f"sm_{cap}a"
        out = subprocess.run(
            [ptxas, "-v", "--gpu-name", arch, f.name, "-o", os.devnull], capture_output=True, text=True
        )
    lines = [ln.split("info    : ")[-1].strip() for ln in out.stderr.splitlines()]
    return "; ".join(ln for ln in lines if "registers" in ln or "spill" in ln) or out.stderr.strip()[-300:]


@pytest.mark.parametrize("cap", [90, 120], ids=["sm_90", "sm_120"])
def test_every_kernel_compiles_for_hopper_and_blackwell(cap):
    # the subprocess imports this checkout's package, not whichever one the interpreter has installed
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root}
    run = subprocess.run(
        [sys.executable, __file__, str(cap)], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0 and "compiled" in run.stdout, (run.stdout + run.stderr)[-4000:]


if __name__ == "__main__":
    failures = compile_all(int(sys.argv[1]), registers="--registers" in sys.argv)
    print("\n".join(failures) or f"compiled {len(kernels(int(sys.argv[1])))} kernels")
    sys.exit(1 if failures else 0)
