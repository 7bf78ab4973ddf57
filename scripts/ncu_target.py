"""Target program for Nsight Compute on a lent GPU (scripts/device_ncu.sh runs it under `ncu`): each kernel
of the decode and prefill paths launched eagerly a few times on the real shapes (k = 10 decode with its
blocks in HBM; a one-shot prompt of `--tokens` tokens over all 512 experts), outside CUDA graphs so that
each launch is one profiled kernel. The first call of each compiles; `device_ncu.sh` skips it. With --fp8:
the FP8 row-scaled GEMV on the three DeltaNet shapes at M = 1 instead (KERNELS=_fp8_gemv_kernel SKIP=3
COUNT=3 profiles each shape's second call)."""

import argparse

import torch

from expertstream.bench.kernels import (
    EXPERTS,
    FP8_SHAPES,
    decode_calls,
    fp8_calls,
    prefill_calls,
    random_bank,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2451, help="prompt tokens of the prefill calls")
    ap.add_argument("--calls", type=int, default=3, help="calls of each path")
    ap.add_argument("--fp8", action="store_true", help="the FP8 GEMV on the DeltaNet shapes instead")
    args = ap.parse_args()
    if args.fp8:
        fp8 = [fp8_calls(n, k, 1, copies=args.calls) for n, k in FP8_SHAPES]
        for i in range(args.calls):  # each shape once a round: its first round compiles
            for calls in fp8:
                calls[i]()
        torch.cuda.synchronize()
        return
    layout, slots, ws2 = random_bank(EXPERTS)
    decode = decode_calls(layout, slots, ws2, "vram")
    prefill, _ = prefill_calls(layout, slots, ws2, args.tokens)
    for i in range(args.calls):
        decode[i % len(decode)]()
        prefill[0]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
