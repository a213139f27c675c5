"""Study: the fidelity an ideal codec would reach at a given bit budget, beside the recipe's, on a trained testbed
(PyTorch path, CPU). It says how far the recipe is from what any codec of a given rate can do, and so whether a
fidelity target at that rate lies within reach.

The ideal codec is the rate-distortion optimum of a Gaussian model of each head's keys and values (their mean and
covariance, fitted on the calibration set): the values are turned into the covariance's eigenbasis, the bits are
shared among the components by reverse water-filling (component i of variance λ_i gets distortion D_i = min(θ, λ_i)
and rate ½·log2(λ_i / D_i), θ set so the rates average ``R`` bits a value), and each component passes the test
channel that reaches that distortion: ŷ = (1 − D/λ)·y + sqrt((1 − D/λ)·D)·n, n standard normal (drawn once for
each stored value). For any source of that covariance this channel carries at most R bits a value, so a vector
quantizer of long enough blocks reaches it; the recipe's scalar codes lose to it the granular gain (about 0.25 bits
at these rates) and whatever their scales and norms cost. A source that is not Gaussian can be coded better still,
so this is what the data's second-order structure allows, not a bound on every codec.

``--weighted`` measures the keys' distortion as the attention scores see it (e^T·E[q·q^T]·e, the query's second
moment of that head) and the values' as the output projection does (e^T·W_oᵀW_o·e, the head's slice), and
water-fills in those metrics.

    python tools/rd_bound_study.py ../shared/testbed/esm2_d64_trained --bits 2 3 4 --recipes default wide --out R.txt
"""

from __future__ import annotations

import argparse
import time

import torch

from esm_turbo import TurboEsm, calibrate
from esm_turbo.experiments.methods import collect_kv
from esm_turbo.model.recipe import recipe
from esm_turbo.quant.codec import DenseQuantizer, KVCodec
from study_common import data_flags, measure, parse, stream


def water_fill(variances: torch.Tensor, bits: float) -> torch.Tensor:
    """Reverse water-filling: variances [..., d] (≥ 0) → distortions [..., d], min(θ, λ_i) per component with θ
    chosen (for each leading index) so that the rates ½·log2(λ_i / D_i) average ``bits`` over the d components."""
    lam = variances.double().clamp_min(1e-30)
    lo = torch.full(lam.shape[:-1], 1e-30, dtype=torch.float64).log()
    hi = lam.max(-1).values.log()
    for _ in range(200):  # bisection on log θ: the mean rate falls as θ rises
        mid = (lo + hi) / 2
        theta = mid.exp()[..., None]
        rate = (0.5 * torch.log2(lam / torch.minimum(theta, lam))).mean(-1)
        lo, hi = torch.where(rate > bits, mid, lo), torch.where(rate > bits, hi, mid)
    return torch.minimum(hi.exp()[..., None], lam).to(variances.dtype)


class IdealQuantizer(DenseQuantizer):
    """One kind (keys or values) of one layer through the Gaussian test channel at ``bits`` a value, in the metric
    ``metric`` [H, d, d] (identity: plain squared error). Stores the channel's output in fp32, so the cache holds
    what a decoder of the ideal code would give back."""

    def __init__(self, x: torch.Tensor, bits: float, metric: torch.Tensor | None = None, seed: int = 0):
        heads, _, dim = x.shape  # x [H, N, d]: the calibration set's values
        super().__init__(heads, dim)
        mean = x.mean(1)
        c = (x - mean[:, None]).transpose(1, 2) @ (x - mean[:, None]) / x.shape[1]  # [H, d, d]
        if metric is None:
            w, w_inv = torch.eye(dim).expand(heads, dim, dim), torch.eye(dim).expand(heads, dim, dim)
        else:  # y = x·W with W = M^½: the metric's squared error becomes plain squared error
            m_val, m_vec = torch.linalg.eigh(metric)
            m_val = m_val.clamp_min(m_val.max(-1, keepdim=True).values * 1e-8)
            w = m_vec @ torch.diag_embed(m_val.sqrt()) @ m_vec.transpose(1, 2)
            w_inv = m_vec @ torch.diag_embed(m_val.rsqrt()) @ m_vec.transpose(1, 2)
        lam, u = torch.linalg.eigh(w.transpose(1, 2) @ c @ w)  # covariance of x·W
        lam = lam.clamp_min(0)
        dist = water_fill(lam, bits)
        alpha = torch.where(lam > 0, 1 - dist / lam.clamp_min(1e-30), torch.zeros_like(lam))
        self.register_buffer("mean", mean)
        self.register_buffer("to_basis", w @ u)  # x → eigen-components of the weighted covariance
        self.register_buffer("from_basis", u.transpose(1, 2) @ w_inv)
        self.register_buffer("alpha", alpha)
        self.register_buffer("beta", (alpha * dist).clamp_min(0).sqrt())
        self.gen = torch.Generator().manual_seed(seed)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = (x.float() - self.mean[:, None]) @ self.to_basis  # [..., H, T, d]
        noise = torch.randn(y.shape, generator=self.gen)
        y_hat = self.alpha[:, None] * y + self.beta[:, None] * noise
        return {"x": y_hat @ self.from_basis + self.mean[:, None]}


def output_metric(model, layer: int, heads: int, dim: int) -> torch.Tensor:
    """[H, d, d]: W_oᵀ·W_o restricted to each head's input columns of layer ``layer``'s output projection."""
    from esm_turbo.model.family import family_of_net
    family = family_of_net(model)
    w = family.layers(model)[layer].get_submodule(family.o).weight.float()  # [hidden, H·d]
    cols = w.reshape(w.shape[0], heads, dim).permute(1, 0, 2)  # [H, hidden, d]
    return cols.transpose(1, 2) @ cols


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", type=float, nargs="+", default=[2.0, 3.0, 4.0], help="all-in bits a value")
    ap.add_argument("--weighted", action="store_true", help="also water-fill in the scores' and output's metrics")
    ap.add_argument("--recipes", nargs="*", default=[], help="also these presets at each integer budget")
    args, model, cal_records, eval_records = parse(ap)
    cfg = model.config
    heads = cfg.num_attention_heads
    dim = cfg.hidden_size // heads
    t0 = time.time()
    kv = collect_kv(model, cal_records, max_tokens=2**30, queries=True)  # [(q, k, v)] per layer
    command = (f"python tools/rd_bound_study.py {args.model} --bits {' '.join(map(str, args.bits))}"
               + (" --weighted" if args.weighted else "")
               + (f" --recipes {' '.join(args.recipes)}" if args.recipes else "") + data_flags(args))
    lines = [f"# {command}",
             f"# {len(eval_records)} held-out sequences, half prefilled exactly, the rest decoded; PyTorch path, CPU; "
             f"Gaussian model fitted on {kv[0][1].shape[1]} calibration tokens a head",
             f"{'codec':<28} {'bits':>5} {'mean cos':>9} {'worst seq':>9} {'worst tok':>9} {'<0.95':>7}"]

    def row(name, bits, r):
        lines.append(f"{name:<28} {bits:>5.2f} {r['mean']:>9.4f} {r['worst']:>9.4f} {r['token']:>9.4f} "
                     f"{r['tail']:>7.2%}")
        print(lines[-1], f"({time.time() - t0:.0f} s)", flush=True)

    engine = TurboEsm(model)
    metrics = [None]
    if args.weighted:
        metrics.append("weighted")
    for bits in args.bits:
        for metric in metrics:
            codecs = []
            for layer, (q, k, v) in enumerate(kv):
                mk = mv = None
                if metric:
                    mk = q.transpose(1, 2) @ q / q.shape[1]  # E[q·qᵀ] per head
                    mv = output_metric(model, layer, heads, dim)
                codecs.append(KVCodec(IdealQuantizer(k, bits, mk, seed=2 * layer),
                                      IdealQuantizer(v, bits, mv, seed=2 * layer + 1)))
            row(f"ideal, {'weighted' if metric else 'squared error'}", bits, measure(engine, eval_records, codecs))
        for name in args.recipes if float(bits).is_integer() and bits >= 2 else []:  # index bits + a sign bit
            cal = calibrate(model, cal_records, recipe(name, index_bits=int(bits) - 1), progress=False)
            r = measure(TurboEsm(model, cal), eval_records, cal.codecs)
            row(f"recipe {name}", r["bits"], r)
    stream(lines, args.out)


if __name__ == "__main__":
    main()
