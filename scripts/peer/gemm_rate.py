#!/usr/bin/env python3
"""The bf16 rate cuBLAS reaches on this GPU, through PyTorch: a large square
product (the ceiling strata's dense GEMMs are held to) and the shapes of a
preset's dense GEMMs at its tokens a step, each timed with CUDA events as
the mean of --reps products after three warm-ups. One JSON line a shape.

  python3 scripts/peer/gemm_rate.py --tokens 8192 --d-model 768 --vocab 257
"""

import argparse
import json


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=257)
    ap.add_argument("--square", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()

    import torch

    dev = torch.device("cuda")
    t, d = a.tokens, a.d_model
    # (rows, inner, columns): y = x · wᵀ for x (rows × inner), w (columns × inner).
    shapes = [("square", a.square, a.square, a.square), ("projection", t, d, d),
              ("head", t, d, a.vocab), ("projection_dw", d, t, d)]
    for name, m, k, n in shapes:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            torch.matmul(x, w.t())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(a.reps):
            torch.matmul(x, w.t())
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / a.reps
        print(json.dumps(dict(shape=name, m=m, k=k, n=n, ms=round(seconds * 1e3, 4),
                              tflop_s=round(2 * m * k * n / seconds / 1e12, 1))))


if __name__ == "__main__":
    main()
