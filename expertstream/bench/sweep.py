"""Launch-shape sweeps (device only): each kernel's candidate configs timed on the real shapes as
`bench kernels` times them, the fastest per shape merged into a tuned_configs.json (docs/kernels.md).
`expertstream bench kernels --tune` runs them for the GPU at hand."""

from __future__ import annotations

from expertstream.bench.kernels import (
    BF16_SHAPES,
    EXPERTS,
    FP8_MODEL_SHAPES,
    HIDDEN,
    INTER,
    TOPK,
    decode_calls,
    fp8_calls,
    graph_ms,
    matvec16_calls,
    pass_calls,
    prefill_calls,
    random_bank,
)

# the fastest configs with the hardware E4M3 conversion on the H200, and their neighbours
FP8_GEMV_SWEEP = [
    dict(block_n=bn, block_k=bk, num_warps=nw, split_k=sk)
    for bn, bk, nw, sk in [
        (16, 256, 4, 1), (16, 512, 8, 1), (8, 1024, 4, 1), (8, 512, 4, 1), (2, 512, 4, 1), (4, 1024, 4, 1),
        (16, 512, 4, 1), (8, 256, 8, 1),
    ]
]  # fmt: skip
# 16-bit rows: few rows a program for the short matrices with long rows (324 x 10,240), more for the rest
MATVEC16_SWEEP = [
    dict(block_n=bn, block_k=bk, num_warps=nw, split_k=1)
    for bn, bk, nw in [
        (1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (4, 512, 4), (8, 512, 4), (16, 256, 4), (2, 2048, 8),
    ]
]  # fmt: skip
DECODE_SWEEP = [
    dict(block_n_gu=ngu, block_g_gu=ggu, block_n_down=nd, block_g_down=gd, split_down=sd, num_warps=nw)
    for ngu, ggu, nd, gd, sd, nw in [
        (4, 32, 16, 8, TOPK, 2), (4, 32, 8, 8, TOPK, 2), (4, 32, 32, 8, TOPK, 4), (2, 64, 16, 8, TOPK, 2),
        (4, 32, 16, 8, 5, 2), (2, 64, 8, 8, 1, 2), (2, 64, 8, 8, TOPK, 2), (8, 16, 16, 8, TOPK, 4),
        (4, 16, 16, 4, TOPK, 2), (8, 32, 32, 4, TOPK, 4),
        # whole 320 B rows of down (64 groups, 40 used) and 1 KB of gate/up per row: longer reads for blocks
        # read over the bus (64 B pieces of down rows took a k=10 call from host RAM 600 us, whole rows 565)
        (2, 64, 8, 64, TOPK, 2), (2, 64, 4, 64, 1, 2), (4, 64, 16, 64, TOPK, 4), (2, 128, 8, 64, TOPK, 4),
    ]
]  # fmt: skip
# the word tiles' shapes. Two-stage shapes (less shared memory, more programs per SM) are within 1 % of
# these or slower
PREFILL_SWEEP = [
    dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
    for bm, bn, bk, nw, ns in [
        (16, 64, 32, 4, 4), (16, 64, 64, 4, 3), (32, 64, 64, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3),
        (128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (64, 64, 128, 4, 3), (16, 128, 32, 4, 4),
        (32, 128, 64, 4, 3), (64, 128, 32, 4, 4), (64, 256, 64, 8, 3),
        # two warp groups on one M = 64 tile (each half the columns): a 64 x 128 program alone on its SM
        # (~160 KB of shared memory) has one warp per scheduler to hide the dequantisation's latencies
        (64, 128, 64, 8, 3), (64, 128, 64, 8, 2), (64, 256, 64, 8, 2), (64, 128, 32, 8, 4),
        (32, 128, 64, 8, 3), (16, 128, 32, 8, 4), (16, 256, 32, 8, 4),
        # four programs an SM (127-128 registers, 41 / 53 KB of shared memory): Nsight Compute found the
        # 64 x 128 x 64 shape (255 registers, two programs) waiting on memory with two warps a scheduler
        (64, 64, 32, 4, 3), (64, 64, 32, 4, 4),
        # for ~10 tokens an expert (T = 512): more loads in flight a program, or more programs (64 registers
        # at block_k 16)
        (16, 64, 32, 4, 6), (16, 64, 16, 4, 6), (16, 64, 16, 4, 8), (16, 128, 16, 4, 6),
    ]
] + [
    # a register cap for a third program an SM: 210 registers uncapped, 168 without spills (SASS, Triton 3.6
    # and 3.9). A cap that does not bind changes nothing, so only this shape names one
    dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=2, maxnreg=168)
] + [
    # scale bytes as int32 words, which the pipeliner stages ahead (Nsight Compute: at T = 2,451 a third of
    # the stall samples wait on the byte loads, issued in the step that uses them); 64 x 64 x 32 with and
    # without a cap at 128 registers (136 uncapped: three programs an SM, four capped, no spills; Triton 3.6).
    # The uncapped one wins at 2,451 and 8,192 tokens, the capped one for the passes
    dict(block_m=bm, block_n=bn, block_k=bk, num_warps=4, num_stages=ns, scale_words=True, **cap)
    for bm, bn, bk, ns, cap in [
        (16, 64, 32, 4, {}), (64, 64, 32, 3, {"maxnreg": 128}), (64, 64, 32, 4, {"maxnreg": 128}),
        (64, 64, 32, 3, {}), (64, 64, 64, 3, {}),
    ]
] + [
    # the shipped shapes launched tile-major (a tile's n blocks together, sharing its input rows in L2):
    # Nsight Compute put down at T = 2,451 at 65 % of DRAM, ~1.5 GB for ~0.6 GB of distinct bytes, as if
    # each n block re-read the 31 MB of h
    dict(block_m=16, block_n=64, block_k=32, num_warps=4, num_stages=4, tile_major=True),
    dict(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3, scale_words=True, tile_major=True),
]  # fmt: skip


# the down launch's own shapes, tried once the shape of both is picked (its K = I is a quarter of H: fewer
# steps per program, and a program per BLOCK_N of H's 2,560 rows)
DOWN_SWEEP = [
    dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
    for bn, bk, nw, ns in [
        (64, 64, 4, 3), (128, 64, 4, 3), (256, 64, 8, 3), (128, 128, 4, 2), (64, 32, 4, 4), (128, 32, 4, 4),
        (64, 128, 4, 2), (128, 64, 8, 3), (256, 32, 8, 4),
    ]
] + [
    # down reading its scales as words under a gate+up that reads bytes (T = 512: gate+up, bound by issue,
    # loses with words; down waits on memory first)
    dict(block_n=bn, block_k=bk, num_warps=4, num_stages=ns, scale_words=True)
    for bn, bk, ns in [(128, 64, 3), (64, 32, 3)]
] + [
    # down alone tile-major (above), under gate+up's shape and under T = 512's 128 x 64 down. Not yet swept
    dict(block_n=64, block_k=32, num_warps=4, num_stages=3, scale_words=True, tile_major=True),
    dict(block_n=128, block_k=64, num_warps=4, num_stages=3, tile_major=True),
]  # fmt: skip


# the first is the tiles' own (ps64) shape: a sweep never records worse; narrower tiles lost
PASS_SWEEP = [
    dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
    for bn, bk, nw, ns in [
        (64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 32, 4, 4), (128, 64, 4, 3), (64, 128, 4, 3),
        (128, 64, 8, 3), (128, 32, 8, 4),
    ]
] + [
    dict(block_n=64, block_k=32, num_warps=4, num_stages=3, scale_words=True, maxnreg=128, tile_major=t)
    for t in (False, True)
]  # fmt: skip


SWEPT = ("fp8_gemv", "matvec16", "nvfp4_decode", "nvfp4_prefill", "nvfp4_prefill_pass")


def sweep_configs(path: str, kernels: tuple[str, ...] = SWEPT, places: tuple[str, ...] = ("host",)) -> dict:
    """Time each candidate config of `kernels` on the real shapes and merge the best per shape into the
    tuned_configs.json data at `path` ({device name: {kernel: {key: cfg}}}; other entries are kept);
    prints one line per candidate. `places`: where the decode kernel's blocks are while its one launch
    shape is timed ("vram", "host": pinned host RAM)."""
    import json
    import os

    import torch

    from expertstream.kernels.nvfp4_moe import prefill_bucket

    def timed(make_calls):
        try:
            return 1e3 * graph_ms(make_calls(), reps=10)
        except Exception as e:  # a config that does not compile (registers, shared memory) is skipped
            print("   skipped:", str(e).splitlines()[0][:120], flush=True)
            return float("inf")

    def pick(kernel: str, key: str, label: str, candidates: list[dict], make_calls) -> dict | None:
        res = []
        for cfg in candidates:
            us = timed(lambda: make_calls(cfg))  # noqa: B023
            print(f"{label} {cfg} {us:.1f} us", flush=True)
            res.append((us, cfg))
        us, cfg = min(res, key=lambda r: r[0])
        if us < float("inf"):
            best.setdefault(kernel, {})[key] = cfg
            return cfg
        return None

    def pick_prefill(key: str, label: str, candidates: list[dict], make_calls) -> None:
        # both launches' shape, then the down launch's own (the first candidate: the same shape)
        cfg = pick("nvfp4_prefill", key, label, candidates, make_calls)
        if cfg is not None:
            downs = [cfg] + [{**cfg, "down": d} for d in DOWN_SWEEP]
            pick("nvfp4_prefill", key, label + " down", downs, make_calls)

    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    best = data.setdefault(torch.cuda.get_device_name(), {})
    if "fp8_gemv" in kernels:
        # M = 2..4 reuse the M = 1 choice (key without M); timed alone (no dependent launch), which the
        # configs do not set
        for n, k in FP8_MODEL_SHAPES:
            pick("fp8_gemv", f"{n}x{k}", f"fp8 M=1 {n}x{k}", FP8_GEMV_SWEEP,
                 lambda cfg: fp8_calls(n, k, 1, {**cfg, "pdl": False}))  # noqa: B023  # fmt: skip
    if "matvec16" in kernels:
        for n, k in BF16_SHAPES:
            pick("matvec16", f"{n}x{k}", f"matvec16 {n}x{k}", MATVEC16_SWEEP,
                 lambda cfg: matvec16_calls(n, k, cfg))  # noqa: B023  # fmt: skip
    layout, slots, ws2 = random_bank(EXPERTS)
    if "nvfp4_decode" in kernels:
        # one shape for blocks wherever they are (it sets the sums' order), timed where `places` says:
        # by default over the bus, the case decode streams in
        def decode_places(cfg: dict) -> list:
            return [c for place in places for c in decode_calls(layout, slots, ws2, place, cfg)]

        pick("nvfp4_decode", f"{HIDDEN}x{INTER}", f"decode k={TOPK} {'+'.join(places)}", DECODE_SWEEP,
             decode_places)  # fmt: skip
    if "nvfp4_prefill" in kernels:  # one call per graph: a prompt's experts are far past L2
        for t in (512, 2451, 8192):
            pick_prefill(f"{HIDDEN}x{INTER}x{prefill_bucket(t * TOPK, EXPERTS)}", f"prefill T={t}",
                         PREFILL_SWEEP, lambda cfg: prefill_calls(layout, slots, ws2, t, cfg)[0])  # noqa: B023  # fmt: skip
    if "nvfp4_prefill_pass" in kernels:  # one engine pass: few experts mapped, the tiles made for all
        pick_prefill(f"{HIDDEN}x{INTER}xpass", "prefill pass", PASS_SWEEP,
                     lambda cfg: pass_calls(layout, slots, ws2, launch=cfg)[0])  # fmt: skip
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return data
