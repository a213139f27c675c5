"""Whether a decode layer's products run faster when their weights are pulled into L2 while the attention walk runs
(GPU; measured, dropped: docs/kernels.md). 650M-shaped at 195 rows, eight layers of distinct weights and 256 MB of
"codes" each in one CUDA graph: a streaming read standing in for the walk (its loads plain or evict-first), then the
QKV / O / FFN-up (+GELU) / FFN-down products in cuBLAS; beside it the same with the layer's O, FFN and the next QKV
weights read on a side stream during the walk (evict-last loads), joined before the O product. µs a layer.

    python tools/l2_prefetch_study.py > results/gpu/l2_prefetch_h100.txt
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from esm_turbo.bench.timing import time_graph


@triton.jit
def _stream(x_ptr, out_ptr, n, per_prog, BLOCK: tl.constexpr, POLICY: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    base = pid.to(tl.int64) * per_prog
    for i in range(0, per_prog, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        if POLICY == 1:
            v = tl.load(x_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
        elif POLICY == 2:
            v = tl.load(x_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
        else:
            v = tl.load(x_ptr + offs, mask=offs < n, other=0)
        acc ^= v
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def stream(buf, out, policy, programs):
    """Every int32 of ``buf`` read by ``programs`` programs (policy 0 plain, 1 evict-first, 2 evict-last)."""
    n = buf.numel()
    per = triton.cdiv(triton.cdiv(n, programs), 4096) * 4096
    _stream[(programs,)](buf, out, n, per, BLOCK=4096, POLICY=policy, num_warps=8)


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    L, M, D = 8, 195, 1280
    h = torch.float16
    codes = [torch.randint(-2**31, 2**31 - 1, (64 << 20,), dtype=torch.int32, device=dev) for _ in range(L)]  # 256 MB
    shapes = dict(qkv=(3 * D, D), o=(D, D), up=(4 * D, D), down=(D, 4 * D))
    W = [{k: torch.randn(*shape, device=dev, dtype=h) * .02 for k, shape in shapes.items()} for _ in range(L + 1)]
    B = [{k: torch.zeros(v.shape[0], device=dev, dtype=h) for k, v in w.items()} for w in W]
    nxt = [W[i + 1]["qkv"].reshape(-1).view(torch.int32) for i in range(L)]
    x = torch.randn(M, D, device=dev, dtype=h)
    sink = torch.zeros(4 * sms * 8, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream()

    def layer(i, policy, prefetch, walk=True):
        y = F.linear(x, W[i]["qkv"], B[i]["qkv"])
        if prefetch:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                stream(W[i]["o"].view(-1).view(torch.int32), sink[sms * 4:], 2, sms // 4)
                stream(W[i]["up"].view(-1).view(torch.int32), sink[sms * 5:], 2, sms // 4)
                stream(W[i]["down"].view(-1).view(torch.int32), sink[sms * 6:], 2, sms // 4)
                stream(nxt[i], sink[sms * 7:], 2, sms // 4)
        if walk:
            stream(codes[i], sink, policy, sms * 4)
        if prefetch:
            torch.cuda.current_stream().wait_stream(side)
        a = F.linear(y[:, :D], W[i]["o"], B[i]["o"])
        u = F.gelu(F.linear(a, W[i]["up"], B[i]["up"]))
        return F.linear(u, W[i]["down"], B[i]["down"])

    def timed(fn):
        return time_graph(fn, dev) * 1e6 / L

    print(torch.cuda.get_device_name(), "µs a layer (8 layers in one graph, distinct weights and codes)")
    walk_only = timed(lambda: [stream(codes[i], sink, 0, sms * 4) for i in range(L)])
    walk_ef = timed(lambda: [stream(codes[i], sink, 1, sms * 4) for i in range(L)])
    print(f"walk-like read of 256 MB: {walk_only:.1f} (evict_first {walk_ef:.1f}); "
          f"{256 * 2**20 / walk_only / 1e3:.0f} GB/s")
    prods = timed(lambda: [layer(i, 0, False, walk=False) for i in range(L)])
    print(f"products (+GELU) alone, back to back: {prods:.1f}")
    for name, pol, pre in (("walk then products", 0, False), ("walk evict_first then products", 1, False),
                           ("walk + prefetch (default policy)", 0, True),
                           ("walk evict_first + prefetch evict_last", 1, True)):
        t = timed(lambda: [layer(i, pol, pre) for i in range(L)])
        print(f"{name}: {t:.1f}  (beyond the walk alone: {t - walk_only:.1f})")


if __name__ == "__main__":
    main()
