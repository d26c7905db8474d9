"""bench_gpu_torch.py: the reference for tests/bench/bench_gpu.lua: the same sizes through torch
(cuBLAS for the GEMMs, torch's own kernels for the rest), timed the same way (warm-up calls, then
the best of 3 rounds between two device synchronisations). Read lunar's numbers against these:
the GEMMs run through cuBLAS in both, so a gap there is lunar's overhead or its choice of
algorithm; the memory-bound ops show how far lunar's kernels are from torch's.

Run by tests/gpu/run.sh when python3 has torch with CUDA; not part of any test suite.
    PYTHONUNBUFFERED=1 python3 tests/bench/bench_gpu_torch.py
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    print("no CUDA device: skipped")
    sys.exit(77)

QUICK = os.environ.get("LUNAR_BENCH_QUICK") == "1"
PEAK = float(os.environ.get("LUNAR_PEAK_TFLOPS") or 989)
dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def timed(fn, secs=0.05, warm=3):
    """seconds per call: warm-up, a repetition count for about `secs` a round, best of 3 rounds"""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    reps = max(1, min(200, int(secs / max(time.perf_counter() - t0, 1e-6))))
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
print(f"\nbf16 GEMM y = x @ W^T (torch.nn.functional.linear); MFU against {PEAK:g} TFLOP/s")
print(f"{'layer':<6} {'tokens':>6} {'hidden':>6} {'K':>6} {'N':>6} {'ms':>10} {'TFLOP/s':>10} {'MFU':>7}")
tokens = [1024, 16384] if QUICK else [1024, 4096, 16384]
hidden = [2048, 6144] if QUICK else [2048, 4096, 6144]
for h in hidden:
    for t in tokens:
        for name, kin, kout in (("proj", 1, 1), ("up", 1, 4), ("down", 4, 1)):
            k, n = h * kin, h * kout
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            y = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
            secs = timed(lambda: torch.matmul(x, w.t(), out=y))
            tf = 2 * t * k * n / secs * 1e-12
            print(f"{name:<6} {t:>6} {h:>6} {k:>6} {n:>6} {secs * 1e3:>10.3f} {tf:>10.1f} {100 * tf / PEAK:>6.1f}%")
            del x, w, y

rows, cols, ce_rows, vocab = 16384, 4096, 2048, 151552
src = torch.randn(rows * cols, device=dev)
dst = torch.empty_like(src)
copy_gbs = 2 * src.numel() * 4 / timed(lambda: dst.copy_(src)) * 1e-9
del src, dst
print(f"\ndevice-to-device copy of {rows * cols * 4 >> 20} MiB: {copy_gbs:.0f} GB/s (bytes read + written)")
print(f"{'op':<24} {'dtype':>5} {'shape':>14} {'ms':>10} {'GB/s':>9} {'of copy':>8}")


def report(name, dt, shape, nbytes, fn):
    secs = timed(fn)
    gbs = nbytes / secs * 1e-9
    print(f"{name:<24} {dt:>5} {shape:>14} {secs * 1e3:>10.3f} {gbs:>9.0f} {100 * gbs / copy_gbs:>7.1f}%")


for dt, tdt, es in (("f32", torch.float32, 4), ("bf16", torch.bfloat16, 2)):
    x = torch.randn(rows, cols, device=dev, dtype=tdt)
    w = torch.ones(cols, device=dev, dtype=tdt)
    n = rows * cols
    shape = f"{rows}x{cols}"
    report("rmsnorm", dt, shape, 2 * n * es, lambda: F.rms_norm(x, (cols,), w, 1e-6))
    report("softmax", dt, shape, 2 * n * es, lambda: torch.softmax(x, -1))
    del x, w
    logits = torch.randn(ce_rows, vocab, device=dev, dtype=tdt)
    targets = torch.randint(0, vocab, (ce_rows,), device=dev)
    report("cross_entropy", dt, f"{ce_rows}x{vocab}", ce_rows * vocab * es,
           lambda: F.cross_entropy(logits, targets, reduction="none"))
    del logits, targets
print("\nbench_gpu_torch: done")
