"""How much of the numeric check's GPU time is reading the gradients at all (issue 48): the same 8 x Linear(4096)
gradients as tests/gpu/test_gpu_numeric.py (134 M parameters, 537 MB in fp32), each variant timed with CUDA events
over 50 repetitions after 10 warm-ups. Needs a CUDA GPU.

    python tests/bench/bench_grad_read_floor.py
"""
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("bench_grad_read_floor: needs a CUDA GPU (none here)")

grads = []
for _ in range(8):
    grads += [torch.randn(4096, 4096, device="cuda"), torch.randn(4096, device="cuda")]
nbytes = sum(g.numel() * g.element_size() for g in grads)


def timed(fn, n=50):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


found = torch.zeros(1, device="cuda")
one = torch.ones(1, device="cuda")
variants = {
    "foreach_norm + stack + isfinite.all (the guard's)": lambda: torch.isfinite(torch.stack(torch._foreach_norm(grads))).all(),
    "foreach_norm alone": lambda: torch._foreach_norm(grads),
    "amp non-finite check (GradScaler's, scale 1)": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one),
    "one read of every gradient (sum)": lambda: [g.sum() for g in grads],
}
print(f"gradients: {nbytes / 1e6:.0f} MB")
for name, fn in variants.items():
    ms = timed(fn)
    print(f"{ms:7.3f} ms  {nbytes / ms / 1e6:7.0f} GB/s  {name}")
