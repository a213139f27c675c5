"""The FP8 activation launch that holds each row in registers (``activation._held_rows_kernel``), timed at every
warp count against the two sweeps, on bf16 rows into e4m3: the attention output's widths (kind ``none``) and FFN-up's
(``gelu``), 16,384 rows; every launch checked bit for bit against the library's own result. CUDA only.

    python tools/held_warps.py > results/embed/held_warps_h100.txt
"""

from __future__ import annotations

import torch
import triton
import triton.testing

from esm_turbo.kernels import activation as A
from esm_turbo.kernels.common import GELU_FORM, GELU_FORMS

ROWS = 16384
CASES = (("none", (640, 1280, 2560)), ("gelu", (2560, 5120, 10240)))


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"µs at {ROWS:,} rows; floor: one read and one write at 3 TB/s; the library takes "
          "activation.held_warps(columns) warps")
    held = A.HOLD_ROWS
    for kind, widths in CASES:
        for f in widths:
            u = (3 * torch.randn(ROWS, f, device="cuda")).to(torch.bfloat16)
            A.HOLD_ROWS = False
            res = {"two sweeps": triton.testing.do_bench(lambda: A.activation_triton(u, kind, fp8=True), rep=300)}
            A.HOLD_ROWS = True
            ref = A.activation_triton(u, kind, fp8=True)
            hi, lo = A.held_chunks(f)
            out = torch.empty(ROWS, f, device="cuda", dtype=torch.float8_e4m3fn)
            scale = torch.empty(ROWS, 1, device="cuda")
            for w in (1, 2, 4, 8, 16):
                def run(w=w):
                    A._held_rows_kernel[(ROWS,)](u, out, scale, ROWS, u.stride(0), F=f, HI=hi, LO=lo,
                                                 KIND=A.KINDS[kind], GELU=GELU_FORMS[GELU_FORM], num_warps=w)
                run()
                assert torch.equal(out.float(), ref.q.float()) and torch.equal(scale, ref.scale)
                res[f"w{w}"] = triton.testing.do_bench(run, rep=300)
            times = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in res.items())
            print(f"{kind} {f} (library: w{A.held_warps(f)}): {times} (floor {u.numel() * 3 / 3e6:.1f})", flush=True)
    A.HOLD_ROWS = held


if __name__ == "__main__":
    main()
