"""Tables and plots from the result rows of the sweeps (``scripts/report.py``).

Writes under ``results/``: ``sweeps/<model>.csv`` (one row per method), ``plots/pareto_<model>.png``
(fidelity vs all-in bits per value), and ``REPORT.md`` with the ablation table (the paper's Table 7),
the per-family table on held-out real sequences (Table 1), the memory breakdown at the 650M shape
(Table 4), the best method at 2/3/4 bits, and the GPU latency tables (Tables 5–6) from
``results/gpu/bench_h100.json`` when it exists.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..window import STEP_MAX
from ..io import atomic_write, atomic_write_text
from ..model.evaluate import TAIL_COS
from .config import QuantConf
from .methods import layout_codecs

COLUMNS = ("quant", "method", "bits_per_value", "bytes_per_token_per_layer", "decode_cos_mean",
           "decode_cos_worst_seq", "decode_cos_min", "decode_tail_share", "top1_agreement", "logit_kl", "attn_rel_err_mean", "score_kl_mean", "fit_seconds")
ABLATIONS = ("turboesm", "turboesm_paper", "turboesm_query_keys", "turboesm_no_rotation", "turboesm_pca_keys", "turboesm_uniform_bits", "turboesm_per_head_widths",
             "turboesm_uniform_tokens", "turboesm_v_unrotated", "turboesm_kv_rotated", "turboesm_head_lut", "turboesm_channel_lut",
             "turboesm_shared_lut", "turboesm_no_residual", "turboesm_keys_first", "turboesm_keys_first_3bit_nosign")
FAMILY_COLORS = {"dense": "black", "int": "tab:orange", "fp8": "tab:brown", "turboquant": "tab:blue",
                 "turboesm": "tab:red", "outlier": "tab:green", "rvq": "tab:purple"}


def load_rows(root: str | Path, sweep: str = "methods") -> dict[str, list[dict]]:
    """model name → rows of one sweep under ``root`` (``<root>/<sweep>/<model>/<quant>[@<data>].json``)."""
    by_model: dict[str, list[dict]] = defaultdict(list)
    for path in sorted(Path(root).glob(f"{sweep}/*/*.json")):
        row = json.loads(path.read_text())
        by_model[row["model"]].append(row)
    return by_model


def write_csv(rows: list[dict], path: Path) -> None:
    def dump(tmp: str) -> None:
        with open(tmp, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
            w.writeheader()
            for r in sorted(rows, key=lambda r: (r["bits_per_value"], r["quant"])):
                w.writerow(r)
    atomic_write(path, dump)


def pareto_plot(rows: list[dict], model: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    panels = (("decode_cos_mean", "decode hidden-state cos vs FP32 cache", False),
              ("top1_agreement", "top-1 agreement of decoded logits", False),
              ("attn_rel_err_mean", "attention-output relative error (mean over layers)", True))
    shown = [r for r in rows if r["method"] != "dense" or r["quant"] == "fp16"]
    for ax, (key, title, logy) in zip(axes, panels):
        for r in shown:
            ax.scatter(r["bits_per_value"], max(r[key], 1e-6), color=FAMILY_COLORS.get(r["method"], "gray"), s=30)
            ax.annotate(r["quant"], (r["bits_per_value"], max(r[key], 1e-6)), fontsize=7, xytext=(3, 2),
                        textcoords="offset points")
        ax.set_xlabel("all-in bits per value (K and V, norms / scales / padding included)")
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=f) for f, c in FAMILY_COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles))
    fig.suptitle(f"KV-cache compression on {model}: fidelity vs memory")
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def _md(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        out.append("| " + " | ".join(f"{x:.4f}" if isinstance(x, float) else str(x) for x in r) + " |")
    return "\n".join(out)


def best_at_bits(rows: list[dict], budgets=(2, 3, 4)) -> list[list]:
    """For each budget: the method with the best mean decode cos among those within the budget."""
    out = []
    for b in budgets:
        fit = [r for r in rows if r["bits_per_value"] <= b + 1e-6]
        if not fit:
            out.append([b, "none fits", "", "", ""])
            continue
        best = max(fit, key=lambda r: r["decode_cos_mean"])
        out.append([b, best["quant"], best["bits_per_value"], best["decode_cos_mean"], best["top1_agreement"]])
    return out


def memory_table(conf_dir: Path, heads: int = 20, dim: int = 64) -> str:
    rows = []
    for path in sorted((conf_dir / "quant").glob("*.yaml")):
        q = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConf),
                                                {k: v for k, v in OmegaConf.load(path).items() if k != "defaults"}))
        codec = layout_codecs(q, heads, dim)
        total = codec.token_bytes(heads)  # a token's bytes over all heads
        parts = ", ".join(f"{n} {math.prod(shape) * torch.empty((), dtype=dt).element_size()}"
                          for n, (shape, dt) in codec.part_specs().items())
        ring = (codec.window + STEP_MAX) * 2 * heads * dim * 2 if codec.window else 0
        values = 2 * heads * dim
        rows.append([q.name, total, 8 * total / values, 2 * values / total, 4 * values / total, parts, ring])
    rows.sort(key=lambda r: r[2])
    return _md(["method", "bytes/token/layer", "bits/value (per token)", "× vs FP16", "× vs FP32",
                "bytes per token-head by part", "fixed bytes/sequence/layer (fp16 window)"], rows)


#: the recipes of the fidelity sweep, by name in its rows at 4.0, 3.0 and 2.0 bits a value all-in (3 + sign, 2 + sign
#: and 1 + sign index bits; ``--bits B``: what ``calibrate --bits B`` picks, with ``--predict-values`` the keys alone
#: at 3.0 and 2.0 — 2.5 and 2.0 bits stored — None where a budget's pick is another row's recipe)
FIDELITY_RECIPES = {"default": ("turboesm", "turboesm_default_3bit", "turboesm_default_2bit"),
                    "--bits B": ("turboesm_budget_4bit", None, None),
                    "--bits B --predict-values": ("turboesm_predicted_4bit", "turboesm_predicted_3bit",
                                                  "turboesm_predicted_2bit"),
                    "--bits B --predict-values --predict-group walk": (
                        "turboesm_predicted_walk_4bit", "turboesm_predicted_walk_3bit", "turboesm_predicted_walk_2bit"),
                    "query-keys": ("turboesm_query_keys", "turboesm_query-keys_3bit", "turboesm_query-keys_2bit"),
                    "no-rotation": ("turboesm_no_rotation", "turboesm_no-rotation_3bit", "turboesm_no-rotation_2bit")}
#: per all-in bit budget a value: the bars (mean, worst sequence's mean, worst token, most tokens under TAIL_COS)
FIDELITY_BARS = {4.0: dict(mean=0.995, worst_seq=0.99, worst_token=0.95), 3.0: dict(mean=0.995, worst_seq=0.99,
                                                                                   tail=0.001),
                 2.0: dict(worst_seq=0.98)}
_BAR_KEYS = {"mean": "decode_cos_mean", "worst_seq": "decode_cos_worst_seq", "worst_token": "decode_cos_min"}


def _misses(rows: list[dict], bars: dict[str, float]) -> list[str]:
    """The bars that the worst of ``rows`` (a recipe's calibration sets) misses."""
    return [name for name, bar in bars.items()
            if (max(r["decode_tail_share"] for r in rows) > bar if name == "tail"
                else min(r[_BAR_KEYS[name]] for r in rows) < bar)]


def _spread(rows: list[dict], key: str) -> str:
    """``lowest (spread)`` of one metric over a recipe's calibration sets."""
    vals = [r[key] for r in rows]
    return f"{min(vals):.4f} (±{(max(vals) - min(vals)) / 2:.4f})" if len(vals) > 1 else f"{vals[0]:.4f}"


def fidelity_section(by_model: dict[str, list[dict]], out: Path) -> str:
    """The recipes of :data:`FIDELITY_RECIPES` on every testbed and calibration set: for each metric the lowest over
    the calibration sets and half their range; a plot of the worst token per model."""
    lines = ["## Fidelity across models and calibration sets", "",
             "Each recipe calibrated on three disjoint sets of 115 real sequences (calibration_data/: the default "
             "set, alt1, alt2) and evaluated on the same 29 held-out ones; each cell is the lowest of the three "
             "(± half their range); bits: all-in bits a value stored (within the budget). Bars: at 4.0 bits all-in "
             "mean ≥ 0.995, worst sequence ≥ 0.99, worst token ≥ 0.95; at 3.0 mean ≥ 0.995, worst sequence ≥ 0.99, "
             f"at most 0.1% of tokens under {TAIL_COS}; at 2.0 worst sequence ≥ 0.98. Run on: the machine a row "
             "names (the same arithmetic on either); — : an H100, with the recipe before value channels up to 6 bits "
             "wide and grid ranges half way out (results/fidelity/README.md).", "",
             "![worst tokens](plots/fidelity_worst_token.png)", ""]
    for i, bits in enumerate((4.0, 3.0, 2.0)):
        table = []
        for model in sorted(by_model, key=lambda m: (int(m.split("-d")[1].split("-")[0]), m)):
            named = defaultdict(list)
            for r in by_model[model]:
                named[r["quant"]].append(r)
            for recipe, names in FIDELITY_RECIPES.items():
                rows = named.get(names[i]) if names[i] else None
                if not rows:
                    continue
                missed = _misses(rows, FIDELITY_BARS[bits])
                machines = sorted({r.get("device", "—") for r in rows})
                table.append([model, recipe, f"{max(r['bits_per_value'] for r in rows):.3g}", len(rows),
                              _spread(rows, "decode_cos_mean"), _spread(rows, "decode_cos_worst_seq"),
                              _spread(rows, "decode_cos_min"), f"{max(r['decode_tail_share'] for r in rows):.2%}",
                              "yes" if not missed else "misses " + ", ".join(m.replace("_", " ") for m in missed),
                              ", ".join(machines)])
        lines += [f"### {bits:.1f} bits per value all-in", "",
                  _md(["model", "recipe", "bits", "sets", "mean", "worst seq", "worst token", f"< {TAIL_COS} (most)",
                       "bars", "run on"], table), ""]
    _fidelity_plot(by_model, out / "plots" / "fidelity_worst_token.png")
    return "\n".join(lines)


def _fidelity_plot(by_model: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = sorted(by_model, key=lambda m: (int(m.split("-d")[1].split("-")[0]), m))
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), sharey=False)
    colors = {"default": "tab:red", "--bits B": "tab:orange", "--bits B --predict-values": "tab:green",
              "--bits B --predict-values --predict-group walk": "tab:olive",
              "query-keys": "tab:blue", "no-rotation": "tab:gray"}
    step = 0.8 / len(FIDELITY_RECIPES)
    labelled = set()
    for i, (ax, bits) in enumerate(zip(axes, (4.0, 3.0, 2.0))):
        for j, (recipe, names) in enumerate(FIDELITY_RECIPES.items()):
            for x, model in enumerate(models):
                ys = [r["decode_cos_min"] for r in by_model[model] if names[i] and r["quant"] == names[i]]
                ax.scatter([x + step * (j - (len(FIDELITY_RECIPES) - 1) / 2)] * len(ys), ys, color=colors[recipe],
                           s=22, label=None if recipe in labelled or not ys else recipe)
                labelled |= {recipe} if ys else set()
        bar = 0.95 if bits == 4.0 else None
        if bar:
            ax.axhline(bar, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(models)), models, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{bits:.1f} bits/value all-in: worst decode token", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("lowest decode-token cos vs FP32 cache (one dot per calibration set)")
    fig.legend(loc="upper center", ncol=len(FIDELITY_RECIPES), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def latency_tables(bench: Path) -> str:
    if not bench.is_file():
        return "_no GPU results yet: run `esm-turbo bench all --out results/gpu/bench_h100.json` on a GPU_"
    b = json.loads(bench.read_text())
    att = [[r["shape"], r["batch"], r["context"], r["fused_us"], r["sdpa_fp16_us"] or "n/a",
            r["two_step_us"] or "n/a", r["speedup_vs_sdpa_fp16"] or "n/a", r["fused_gbs"]] for r in b["attention"]]
    out = [f"GPU: {b['device']}; device-to-device copy {b['peak_copy_gbs']:.0f} GB/s.", "",
           "Decode attention per layer call (µs; one new token per sequence):", "",
           _md(["shape", "B", "T", "fused", "fp16 SDPA", "two-step", "× SDPA", "GB/s"], att)]
    if b.get("decode"):
        out += ["", "End-to-end decode (650M-shaped, 1K context, one KV budget):", "",
                _md(["cache", "batch", "KV GiB", "tokens/s", "ms/step"],
                    [[r["cache"], r["batch"], r["kv_gib"], r["tokens_per_s"], r["step_ms"]] for r in b["decode"]])]
    if b.get("quantize"):
        q = b["quantize"]
        out += ["", f"Quantize-and-pack of a {q['tokens']}-token prefill ({q['model']}): {q['quantize_pack_ms']:.3f} ms "
                    f"alone vs prefill {q['prefill_ms']:.2f} ms ({100 * q['fraction']:.1f}%); writing the cache adds "
                    f"{q.get('added_ms', float('nan')):.3f} ms ({100 * q.get('added_fraction', float('nan')):.1f}%) "
                    "to the prefill."]
    if b.get("embed"):
        e = b["embed"]
        out += ["", f"Embedding extraction ({e['model']}, {e['tokens']} tokens): transformers {e['hf_tokens_per_s']:.0f} "
                    f"tokens/s, esm-turbo embed {e['ours_tokens_per_s']:.0f} tokens/s ({e['speedup']:.2f}×)."]
    return "\n".join(out)


def make_report(rows_root: str | Path = "results/rows", out: str | Path = "results",
                conf_dir: str | Path = "conf") -> Path:
    out, conf_dir = Path(out), Path(conf_dir)
    by_model = load_rows(rows_root)
    lines = ["# esm_turbo results (generated by `python scripts/report.py`; do not edit by hand)", "",
             "Models: `trained-*` are ESM-2s trained with masked-LM on real proteins (the first testbed; `-outliers`: "
             "function-preserving K/V outliers planted), `stress-*` random-weight stress models (a second opinion). "
             "Decode cos: final hidden state of each teacher-forced decode token (the second half of each held-out "
             f"sequence) against the FP32 cache; worst seq: the lowest sequence mean; worst token: the lowest token; "
             f"< {TAIL_COS}: the share of decode tokens under {TAIL_COS}.", ""]
    fidelity = load_rows(rows_root, "fidelity")
    if fidelity:
        lines += fidelity_section(fidelity, out), ""
    for model, rows in sorted(by_model.items(), key=lambda kv: (not kv[0].startswith("trained"), kv[0])):
        write_csv(rows, out / "sweeps" / f"{model}.csv")
        pareto_plot(rows, model, out / "plots" / f"pareto_{model}.png")
        by_name = {r["quant"]: r for r in rows}
        lines += [f"## {model}", "", f"![pareto](plots/pareto_{model}.png)", "", f"All methods: `sweeps/{model}.csv`.", "",
                  "### Best method within a bits-per-value budget (all-in bits, best mean decode cos)", "",
                  _md(["budget", "method", "bits/value", "decode cos", "top-1"], best_at_bits(rows)), "",
                  "### Ablations (paper's Table 7)", "",
                  _md(["recipe", "bits/value", "decode cos", "worst seq", "worst token", f"< {TAIL_COS}", "top-1",
                       "attn err", "score KL"],
                      [[n, by_name[n]["bits_per_value"], by_name[n]["decode_cos_mean"], by_name[n]["decode_cos_worst_seq"],
                        by_name[n]["decode_cos_min"], f"{by_name[n]['decode_tail_share']:.2%}",
                        by_name[n]["top1_agreement"], by_name[n]["attn_rel_err_mean"], by_name[n]["score_kl_mean"]]
                       for n in ABLATIONS if n in by_name]), ""]
        if "turboesm" in by_name:
            groups = by_name["turboesm"]["groups"]
            lines += ["### TurboESM (default) per SCOP class on held-out real sequences (Table 1)", "",
                      _md(["class", "n", "prefill cos", "decode cos", "min cos", "top-1", "KL"],
                          [[g, s["n"], s["prefill_cos"], s["decode_cos_mean"], s["decode_cos_min"], s["top1_agreement"],
                            s["logit_kl"]] for g, s in groups.items()]), "",
                      "Per-layer attention-output error / score KL (default): " + ", ".join(
                          f"L{i} {e:.3f}/{k:.3f}" for i, (e, k) in enumerate(
                              zip(by_name["turboesm"]["layers"]["attn_rel_err"],
                                  by_name["turboesm"]["layers"]["score_kl"]))), ""]
    lines += ["## Memory at the ESM-2 650M shape (20 heads, d = 64; Table 4)", "", memory_table(conf_dir), "",
              "## GPU latency (Tables 5–6)", "", latency_tables(out / "gpu" / "bench_h100.json"), ""]
    path = out / "REPORT.md"
    atomic_write_text(path, "\n".join(lines))
    return path
