"""``esm-turbo``: calibrate, evaluate, embed, quantize-weights, bench, validate-codec, demo."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import re
import sys
import time

import torch

from .errors import EsmTurboError
from .fasta import CALIBRATION_DATA
from . import cli_checks as checks
from .embed.benchmark import EMBED_BENCH_EXTRA, EMBED_BENCH_SIZES
from .embed.extract import TOKS_PER_BATCH
from .model.recipe import PRESETS, CalibrationConfig
from .model.family import MAX_CONTEXT
from .model.sizes import ESM2_SIZES, MAX_RESIDUES
from .quant import SUPPORTED_BITS
from .schema import DTYPES, add_flags

log = logging.getLogger("esm_turbo")


def _dump_json(obj, path: str | None) -> None:
    text = json.dumps(obj, indent=2, default=float)
    if path in (None, "-"):
        sys.stdout.write(text + "\n")
    else:
        from .io import atomic_write_text
        atomic_write_text(path, text + "\n")


def _head_dim(text: str) -> int:
    value = checks.int_in(8, 1024)(text)
    if value % 8:
        raise argparse.ArgumentTypeError(f"{value} is not a multiple of 8 (ESM-2's heads: 16, 24, 32, 64, 128)")
    return value


def cmd_validate_codec(args) -> int:
    from .quant.validate import validate_codec
    rows = [validate_codec(b, d, args.vectors, args.seed) for b in args.bits for d in args.head_dim]
    if args.json:
        _dump_json(rows, None)
        return 0
    print(f"{'bits':>4} {'d':>4} {'MSE':>9} {'lower':>9} {'upper':>9} {'ok':>3} {'ip bias':>10} "
          f"{'ip bias+QJL':>12} {'B/vec':>6} {'B/vec+QJL':>9}")
    for r in rows:
        print(f"{r['bits']:>4} {r['head_dim']:>4} {r['mse']:>9.5f} {r['mse_lower_bound']:>9.5f} "
              f"{r['mse_upper_bound']:>9.5f} {'yes' if r['within_bounds'] else 'NO':>3} {r['ip_bias']:>+10.5f} "
              f"{r['ip_bias_qjl']:>+12.5f} {r['bytes_per_vector']:>6} {r['bytes_per_vector_qjl']:>9}")
    print("MSE: E‖x-x̂‖² over random unit vectors (randomized Hadamard, sphere Lloyd-Max LUT, fp16 norm);"
          " ip bias: mean ⟨x,x̂⟩-⟨x,x⟩.")
    return 0


def _config_from_args(args):
    """The recipe a calibrate command asks for: its preset ("auto": the default's, then the candidates) at
    ``--index-bits``, with every recipe flag given (:class:`~esm_turbo.model.recipe.CalibrationConfig`'s fields)."""
    from .model.recipe import PRESETS, CalibrationConfig, recipe
    from .schema import overrides_from_args
    preset = args.preset if args.preset in PRESETS else "default"
    with _fields_as_flags(CalibrationConfig):
        return recipe(preset, args.index_bits, **overrides_from_args(args, CalibrationConfig))


@contextlib.contextmanager
def _fields_as_flags(cls):
    """A ValueError of a config dataclass ``cls`` as the one-line error of the command, its field names written as the
    flags the user gave (``max_channel_bits`` → ``--max-channel-bits``)."""
    try:
        yield
    except ValueError as err:
        message = str(err)
        for f in dataclasses.fields(cls):
            message = re.sub(rf"\b{f.name}\b", f"--{f.name.replace('_', '-')}", message)
        raise EsmTurboError(message) from None


def _check_inputs(device: str | None, model: str, fastas: list[str], fasta_flag: str = "--fasta") -> None:
    """What every model-loading command checks first: the device, the model path, the FASTA files."""
    if device is not None:
        checks.device(device)
    checks.model_source(str(model))
    for path in fastas:
        checks.input_file(path, fasta_flag, "FASTA file")


def cmd_calibrate(args) -> int:
    from .fasta import read_fastas
    from .model.holdout import calibrate_held_out, format_summary
    from .model.loading import load_esm
    _check_inputs(args.device, args.model, args.fasta)
    checks.output_file(args.out, "--out")
    checks.not_an_input(args.out, [*args.fasta, args.model], "--out")
    from .io import remove_stale_temporaries
    remove_stale_temporaries(args.out)  # what a killed run left beside its output
    cfg = _config_from_args(args)
    if args.bits is not None and args.index_bits is not None:
        raise EsmTurboError("give --bits (all-in) or --index-bits, not both")
    records = read_fastas(args.fasta, max_residues=args.max_residues)
    from .model.holdout import split_holdout
    if not split_holdout(records, args.holdout, cfg.seed)[0]:
        raise EsmTurboError(f"--holdout {args.holdout} of {len(records)} sequences leaves none to calibrate on: give "
                            f"more sequences or a smaller --holdout")
    if args.preset == "auto" and (args.holdout == 0 or len(records) < 2):
        raise EsmTurboError("--preset auto picks a recipe on a held-out part of the calibration set: give --holdout > 0 "
                            "and at least two sequences")
    model = load_esm(args.model, DTYPES[args.dtype], args.device)
    if args.bits is not None:
        cfg = _budget_recipe(cfg, args, model)
    start = time.perf_counter()
    result = calibrate_held_out(model, records, cfg, args.preset, args.holdout, seed=cfg.seed,
                                progress=not args.quiet, model_name=str(args.model))
    cal = result.calibration
    path = cal.save(args.out)
    seconds = time.perf_counter() - start
    size = path.stat().st_size
    log.info("wrote %s (%.2f MB) in %.1f s on %s", path, size / 1e6, seconds, args.device)
    for name, summary in result.candidates.items():
        print(f"  {name:<12} on the held-out part: {format_summary(summary)}")
    print(f"calibration ({result.chosen}): {cal.meta['calibration_sequences']} sequences, "
          f"{cal.meta['calibration_tokens']} tokens, {seconds:.1f} s; checkpoint {path} ({size / 1e6:.2f} MB)")
    if "narrowed_layers" in cal.meta:
        print(f"layers {cal.meta['narrowed_layers']} one index bit narrower (the least sensitive on the calibration "
              f"set) for {cal.config.slots} slot(s) a token")
    if result.summary is not None:
        print(f"expect, on {result.summary['sequences']} held-out sequences: {format_summary(result.summary)}")
    return 0


def _budget_recipe(cfg, args, model):
    """``--bits``: the recipe made to store that many bits a value all-in in ``model`` (recipe.for_budget), the recipe
    flags the user gave kept."""
    from .model.family import family_of
    from .model.recipe import CalibrationConfig, for_budget
    from .schema import overrides_from_args
    shape = model.config
    heads = shape.num_attention_heads
    with _fields_as_flags(CalibrationConfig):
        cfg = for_budget(cfg, args.bits, shape.num_hidden_layers, heads, shape.hidden_size // heads,
                         keep=frozenset(overrides_from_args(args, CalibrationConfig)),
                         family=family_of(shape).name)
    extra = f", {cfg.slots} slot(s) a token paid by {cfg.narrow_layers} narrowed layer(s)" if cfg.slots else ""
    if cfg.predict_values:
        extra += (", values not stored: predicted from the keys" if cfg.value_index_bits == 0 else
                  ", values coded as what the keys do not predict")
    widths = cfg.resolved()  # the split rule applied: the widths it calibrates
    print(f"recipe for {args.bits} bits a value all-in: {widths.key_index_bits} + {widths.value_index_bits} index bits "
          f"(keys + values{', and a sign bit' if cfg.residual == 'sign' else ''}){extra}")
    return cfg


def cmd_evaluate(args) -> int:
    from dataclasses import replace

    from .fasta import read_fastas
    from .model.calibrate import calibrate
    from .model.checkpoint import PRESETS, Calibration, with_mean_bits
    from .model.engine import TurboEsm
    from .model.evaluate import evaluate, format_table
    from .model.loading import load_esm
    _check_inputs(args.device, args.model, args.fasta)
    checks.input_file(args.calibration, "--calibration", "calibration checkpoint")
    if args.ablations:
        for path in args.calibration_fasta:
            checks.input_file(path, "--calibration-fasta", "FASTA file")
    if args.json not in (None, "-"):
        checks.output_file(args.json, "--json")
        checks.not_an_input(args.json, [*args.fasta, args.model, args.calibration, *args.calibration_fasta], "--json")
        from .io import remove_stale_temporaries
        remove_stale_temporaries(args.json)
    records = read_fastas(args.fasta)
    if args.limit:
        records = records[: args.limit]
    variants = {"turbo": Calibration.load(args.calibration, args.device)}  # a bad checkpoint is refused first
    model = load_esm(args.model, DTYPES[args.dtype], args.device)
    cal_records = read_fastas(args.calibration_fasta) if args.ablations else []
    base = variants["turbo"].config
    reports = {}
    for name in ["turbo", *(args.ablations or [])]:
        try:  # an ablation that fails is reported as an error row; the others are kept
            cal = variants.get(name)
            if cal is None:
                cfg = with_mean_bits(PRESETS[name], (base.key_index_bits + base.value_index_bits) // 2)  # the same index bits
                if base.residual == "none":  # and no residual bit where the checkpoint has none: the same memory
                    cfg = replace(cfg, residual="none")
                cal = calibrate(model, cal_records, cfg, progress=not args.quiet)
            reports[name] = evaluate(TurboEsm(model, cal), records, "turbo", args.prefix_fraction, args.max_steps,
                                     progress=not args.quiet)
            reports[name]["config"] = cal.config.__dict__
        except (EsmTurboError, ValueError, RuntimeError) as err:
            if name == "turbo":
                raise
            reports[name] = {"error": f"{type(err).__name__}: {err}"}
            log.error("ablation %s failed: %s (the other rows are kept)", name, err)
    if args.json:
        _dump_json(reports, args.json)
    if not args.json or args.json != "-":
        for name, rep in reports.items():
            print(f"== {name}: error: {rep['error']}" if "error" in rep
                  else format_table(rep, f"== {name}: {rep['config']}"))
            print()
    return 0


def cmd_quantize_weights(args) -> int:
    from .model.loading import load_esm
    from .weights import WeightQuantConfig, is_quantized_dir, quantize_model, save_quantized, weight_memory
    from .io import remove_stale_temporaries
    _check_inputs(args.device, args.model, [])
    if is_quantized_dir(args.model):
        raise EsmTurboError(f"--model {str(args.model)!r}: is already quantized (esm-turbo quantize-weights); quantize "
                            f"the model it was made from")
    out = checks.output_dir(args.out, "--out")
    checks.not_an_input(out, [args.model], "--out")
    if out.is_dir() and any(out.iterdir()):
        raise EsmTurboError(f"--out {str(out)!r}: folder is not empty; name a new folder")
    remove_stale_temporaries(out)  # what a killed save left beside it
    with _fields_as_flags(WeightQuantConfig):
        cfg = WeightQuantConfig(bits=args.bits, group=args.group, residual=args.residual, seed=args.seed)
    start = time.perf_counter()
    model = quantize_model(load_esm(args.model, device=args.device), cfg, source=str(args.model),
                           progress=not args.quiet)
    save_quantized(model, out)
    mem = weight_memory(model)
    print(f"quantized {len(model.weight_quant['quantized'])} linears of {args.model} to {cfg.bits} bits"
          f"{' + a residual pass' if cfg.residual else ''} in {time.perf_counter() - start:.1f} s; {out}: weights "
          f"{mem['total_bytes'] / 2**20:.1f} MiB, {mem['ratio_vs_fp16']:.3f}x the fp16 model "
          f"({mem['fp16_bytes'] / 2**20:.1f} MiB)")
    return 0


def cmd_embed(args) -> int:
    from .embed.command import run_embed
    _check_inputs(args.device, args.model, args.fasta, "fasta")
    if args.format is None:  # by the name given: out.h5 is one HDF5 file, anything else a folder of .pt files
        args.format = "h5" if str(args.output).lower().endswith((".h5", ".hdf5")) else "pt"
    checks.not_an_input(args.output, [*args.fasta, args.model], "--output")
    if args.format == "h5":
        checks.output_file(args.output, "--output", hdf5=True)
    else:
        checks.output_dir(args.output, "--output")
    if args.resume and args.overwrite:
        raise EsmTurboError("--resume adds to an output and --overwrite replaces it: pass one of them")
    from .embed.launch import launch_if_asked
    code = launch_if_asked(args.argv, args.gpus)  # --gpus N: the ranks, each running this command
    return run_embed(args) if code is None else code


def cmd_bench(args) -> int:
    from .bench import format_result, run, to_json
    if args.device is not None:
        checks.device(args.device)
    if args.out:
        checks.output_file(args.out, "--out")
        checks.not_an_input(args.out, [*(args.fasta or []), *([args.corpus] if args.corpus else [])], "--out")
        from .io import remove_stale_temporaries
        remove_stale_temporaries(args.out)
    if args.suite == "weights":
        return _bench_weights(args)
    if args.suite == "design":
        return _bench_design(args)
    if args.suite == "widths" and not (torch.cuda.is_available() and (args.device or "cuda").startswith("cuda")):
        raise EsmTurboError("bench widths times the fused kernel against a pure read of its bytes: it needs a CUDA "
                            "device")
    if args.sizes and args.suite not in ("embed", "weights"):
        raise EsmTurboError(f"--sizes: the {args.suite} suite runs its own shapes (--sizes chooses those of the embed "
                            f"and weights suites)")
    embed_sizes = [*EMBED_BENCH_SIZES, *EMBED_BENCH_EXTRA]
    if args.sizes and set(args.sizes) - set(embed_sizes):
        raise EsmTurboError(f"--sizes {' '.join(sorted(set(args.sizes) - set(embed_sizes)))}: the embed suite "
                            f"takes {', '.join(embed_sizes)}")
    if args.corpus is not None:
        checks.input_file(args.corpus, "--corpus", "FASTA file")
    res = run(quick=args.quick, device=args.device, reference=args.reference, suite=args.suite, fasta=args.fasta,
              sizes=args.sizes, corpus=args.corpus)
    text = to_json(res) if args.json else format_result(res)
    print(text)
    if args.out:
        from .io import atomic_write_text
        atomic_write_text(args.out, to_json(res) if args.out.endswith(".json") else format_result(res) + "\n")
    return 0


def _bench_design(args) -> int:
    from .bench.design import bench_design, design_json, format_design
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    small = args.quick or device.type == "cpu"  # on CPU a smoke run at a small shape, not a speed claim
    res = (bench_design(device, "8M", prefix=128, candidates=16, tail=16, block_size=16) if small
           else bench_design(device))
    _print_and_save(args, format_design(res), design_json(res))
    return 0


def _print_and_save(args, text: str, data: dict) -> None:
    print(json.dumps(data, indent=1) if args.json else text)
    if args.out:
        from .io import atomic_write_text
        atomic_write_text(args.out, json.dumps(data, indent=1) if args.out.endswith(".json") else text + "\n")


def _bench_weights(args) -> int:
    from .bench.weights import WEIGHT_SIZES, bench_weights, format_weights, weights_json
    if not torch.cuda.is_available() or (args.device or "cuda").startswith("cpu"):
        raise EsmTurboError("bench weights times the CUDA kernel against cuBLAS: it needs a CUDA device")
    sizes = args.sizes or list(WEIGHT_SIZES)
    unknown = sorted(set(sizes) - set(WEIGHT_SIZES))
    if unknown:
        raise EsmTurboError(f"--sizes {' '.join(unknown)}: bench weights takes {', '.join(WEIGHT_SIZES)}")
    res = bench_weights(torch.device(args.device or "cuda"), sizes, tune=args.tune, progress=True)
    _print_and_save(args, format_weights(res), weights_json(res))
    return 0


def cmd_demo(args) -> int:
    """Offline end-to-end run on a STAND-IN model (random ESM-2 weights with planted outliers)."""
    from .fasta import read_fastas
    from .model.calibrate import calibrate
    from .model.checkpoint import PRESETS, Calibration
    from .model.engine import TurboEsm
    from .model.evaluate import evaluate, format_table
    from .testing import save_stress_model
    for path, flag in ((args.calibration_fasta, "--calibration-fasta"), (args.eval_fasta, "--eval-fasta")):
        checks.input_file(path, flag, "FASTA file")
    out = checks.output_dir(args.out, "--out")
    out.mkdir(parents=True, exist_ok=True)
    print(f"STAND-IN MODEL: pretrained ESM-2 weights cannot be downloaded here; using a {args.size}-shaped "
          f"ESM-2 with random weights and planted outliers (esm_turbo.testing.stress_esm2).")
    model_dir = save_stress_model(out / "stand_in_model", size=args.size, layers=None, hidden=None, heads=None)
    from .model.loading import load_esm
    model = load_esm(model_dir)
    cal_records = read_fastas([args.calibration_fasta])
    eval_records = read_fastas([args.eval_fasta])[: args.limit]
    reports = {}
    for name in ("default", "paper", "no-rotation"):
        start = time.perf_counter()
        cal = calibrate(model, cal_records, PRESETS[name], progress=not args.quiet, model_name=str(model_dir))
        secs = time.perf_counter() - start
        ckpt = cal.save(out / f"calibration_{name}.safetensors")
        cal = Calibration.load(ckpt)
        rep = evaluate(TurboEsm(model, cal), eval_records, "turbo", 0.5, args.max_steps, progress=not args.quiet)
        rep["calibration_seconds"] = secs
        rep["checkpoint_bytes"] = ckpt.stat().st_size
        reports[name] = rep
        print(format_table(rep, f"== recipe {name} (calibration {secs:.1f} s, checkpoint {ckpt.stat().st_size / 1e6:.2f} MB)"))
        print()
    _dump_json(reports, str(out / "demo_report.json"))
    print(f"wrote {out / 'demo_report.json'}")
    return 0


#: what --model takes, for every command that loads a model
MODEL_HELP = ("ESM-2 or ESM C: a size (8M…15B, ESMC-300M…), hub id, save_pretrained dir, fair-esm .pt or the ESM C "
              "package's .pth")


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"esm-turbo: error: {self.prog.removeprefix('esm-turbo ')}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="esm-turbo", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate-codec", help="codec MSE and inner-product bias on random unit vectors")
    p.add_argument("--bits", type=int, choices=list(SUPPORTED_BITS), nargs="+", default=[2, 3, 4])
    p.add_argument("--head-dim", type=_head_dim, nargs="+", default=[64, 128], help="multiples of 8")
    p.add_argument("--vectors", type=checks.int_in(2, 1 << 20), default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate_codec)

    def model_args(p):
        p.add_argument("--model", required=True, help=MODEL_HELP)
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                       help="cpu, cuda, cuda:N or mps (default: cuda when available)")
        p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
        p.add_argument("--quiet", action="store_true", help="no progress bars")

    p = sub.add_parser("calibrate", help="fit rotations, LUTs and residual scales; write a checkpoint")
    model_args(p)
    p.add_argument("--fasta", nargs="+", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--preset", choices=[*PRESETS, "auto"], default="default",
                   help="a recipe; auto: try default, query-keys, no-rotation and keys-first at the same bits and keep "
                        "the best on the held-out part (worst sequence, then worst token, then mean)")
    p.add_argument("--holdout", type=checks.float_in(0.0, 0.9), default=0.2,
                   help="share of the calibration sequences (at most 32) held out to measure the checkpoint on; the "
                        "result is printed and stored in its metadata (0: fit on all, measure nothing)")
    p.add_argument("--bits", type=checks.int_in(2, 5),
                   help="all-in bits a value to store (instead of --index-bits): that many less the sign bit's index "
                        "bits; at 4 and heads of 16 also one slot a token, paid for by the fewest least sensitive "
                        "layers narrowed (the recipe that measured best there, docs/recipe.md)")
    p.add_argument("--index-bits", type=checks.int_in(1, 4),
                   help="mean index bits per value (default 3; + 1 sign bit: 4.0 bits all-in); the preset's key/value "
                        "split is kept within widths 1..4 (keys-first: keys one bit more, values one less; the "
                        "default under 4 bits all-in, e.g. --index-bits 3 --residual none, gives keys 4 and values 2)")
    recipe_flags = p.add_argument_group("recipe (each overrides the preset's value)")
    add_flags(recipe_flags, CalibrationConfig, PRESETS["default"])
    p.add_argument("--max-residues", type=checks.int_in(1, 1022), default=1022)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("quantize-weights", help="ESM-2's block linears in 2-4 bits (rotated groups, a codebook, "
                                                "per-row scales); the folder loads wherever --model is taken")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--out", required=True, help="a new folder for the quantized model")
    p.add_argument("--bits", type=checks.int_in(2, 4), default=4, help="bits per weight (default 4)")
    p.add_argument("--group", type=checks.int_in(8, 4096), default=32,
                   help="input channels per rotation group and scale, a power of two (default 32; a layer it does not divide "
                        "takes the largest power of two that does)")
    p.add_argument("--residual", action="store_true", help="a second pass over the first's error (twice the bytes)")
    p.add_argument("--seed", type=int, default=0, help="seed of the rotations")
    p.add_argument("--device", default="cpu", help="where to quantize: cpu, cuda, cuda:N (default: cpu)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_quantize_weights)

    p = sub.add_parser("evaluate", help="decode fidelity vs the FP32-cache reference")
    model_args(p)
    p.add_argument("--calibration", required=True)
    p.add_argument("--fasta", nargs="+", required=True)
    p.add_argument("--prefix-fraction", type=checks.float_in(0.0, 1.0), default=0.5)
    p.add_argument("--max-steps", type=checks.int_in(1), help="decode at most this many residues per sequence")
    p.add_argument("--limit", type=checks.int_in(1), help="evaluate only the first N sequences")
    p.add_argument("--ablations", nargs="*", choices=[n for n in PRESETS if n != "default"],
                   default=[], help="also calibrate and evaluate these recipes")
    p.add_argument("--calibration-fasta", nargs="+", default=["calibration_data/calibration.fasta"])
    p.add_argument("--json", nargs="?", const="-", help="write JSON (to a path, or stdout with no path)")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("embed", help="extract ESM-2 embeddings from FASTA (fair-esm compatible outputs)")
    p.add_argument("fasta", nargs="+", help="FASTA file(s)")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("-o", "--output", "--output-dir", dest="output", required=True,
                   help="output folder (--format pt) or .h5 file (--format h5)")
    p.add_argument("--repr-layers", "--repr_layers", dest="repr_layers", type=int, nargs="+", default=[-1],
                   help="layers to save (0 = embeddings; negative counts from the end, as in fair-esm)")
    p.add_argument("--include", nargs="+", default=["mean"], help="mean per_tok bos contacts logits")
    p.add_argument("--toks-per-batch", "--toks_per_batch", dest="toks_per_batch", type=checks.int_in(3),
                   default=TOKS_PER_BATCH,
                   help="tokens per batch (packed, no padding; with contacts, padded as in fair-esm)")
    p.add_argument("--truncation-seq-length", "--truncation_seq_length", dest="truncation_seq_length",
                   type=checks.int_in(1, MAX_CONTEXT), default=MAX_RESIDUES,
                   help=f"residues per pass (default {MAX_RESIDUES}: ESM-2's trained context; ESM C's is "
                        f"{MAX_CONTEXT})")
    p.add_argument("--long-policy", choices=["truncate", "windows"], default="truncate",
                   help="longer sequences: keep the first residues (warns, naming the record) or stitch "
                        "overlapping windows per residue")
    p.add_argument("--window-overlap", type=checks.int_in(0), default=None,
                   help="residues shared by neighbouring windows (default: 256, at most a quarter of the window)")
    p.add_argument("--format", choices=["pt", "h5"], default=None,
                   help="pt: a .pt file per record (fair-esm's); h5: one HDF5 file (default: h5 for an output named "
                        "*.h5 or *.hdf5, else pt)")
    p.add_argument("--dtype", choices=["auto", "fp32", "fp16", "bf16", "fp8"], default="auto",
                   help="compute dtype (auto: fp16 on CUDA, fp32 on CPU; fp8: the matrix products in FP8 e4m3 on GPUs "
                        "that have it, the rest in bf16); outputs are stored as float32")
    p.add_argument("--fp8-keep", type=int, nargs="+", default=[], metavar="BLOCK",
                   help="with --dtype fp8: blocks whose products stay in bf16 (0 the first, -1 the last); the trained "
                        "ESM C testbed holds every FP8 fidelity bar with --fp8-keep 0 (docs/embed-speed.md)")
    p.add_argument("--gelu", choices=["erf", "tanh"], default=None,
                   help="ESM-2's GELU: erf (the model's own; the default) or tanh (GELU's tanh approximation: 5-7%% "
                        "faster on Hopper, embeddings within cosine 0.99999 of erf's; docs/embed-speed.md)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu… (default: cuda when available)")
    p.add_argument("--nogpu", action="store_true", help="run on CPU (fair-esm's flag)")
    p.add_argument("--offload-residual", action="store_true",
                   help="a model quantized with --residual: keep the residual pass in pinned host memory, each layer's "
                        "copied to the GPU while the layer before computes")
    p.add_argument("--resume", action="store_true",
                   help="add the records missing from an output made the same way (model, dtype, layers, includes)")
    p.add_argument("--overwrite", action="store_true", help="replace an output that already holds embeddings")
    p.add_argument("--writers", type=checks.int_in(0, 64), default=None,
                   help="writer processes per GPU (default: 1 for h5, up to 4 for pt; 0 writes in the loop's process)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="skip malformed / invalid records (reported) instead of stopping")
    p.add_argument("--strip-gaps", action="store_true",
                   help="remove alignment gaps ('-', '.') before embedding; without it they are embedded as the "
                        "ESM-2 tokens they are")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--gpus", default=None,
                   help="N or all: N rank processes on this host, one GPU each, each embedding a share balanced by "
                        "tokens (as under torchrun, without it)")
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("bench", help="kernel / quantize / decode speed vs baselines measured in the same run")
    p.add_argument("suite", nargs="?", choices=["decode", "widths", "embed", "weights", "design", "all"],
                   default="decode",
                   help="decode: attention kernel, quantize-and-pack, decode tokens/s; widths: the decode attention "
                        "at 4.0 and 3.0 bits all-in against its read floor (CUDA; also in decode); embed: extraction "
                        "vs transformers; weights: the 4-bit weight kernel vs fp16 (CUDA); design: forks of one "
                        "scaffold on the paged, contiguous and fp16 caches; all: decode and embed")
    p.add_argument("--fasta", nargs="+", default=None, help="FASTA for the embed suite (default: calibration_data)")
    p.add_argument("--corpus", default=None,
                   help="embed suite: instead of the suite, run esm-turbo embed end to end on this FASTA (h5 and pt, "
                        "cold and warm) beside a careful user's transformers script, for each of --sizes (default "
                        "650M)")
    p.add_argument("--sizes", nargs="+", choices=[*EMBED_BENCH_SIZES, *EMBED_BENCH_EXTRA, "15B"], default=None,
                   help="embed suite: only these shapes (default: 8M 150M 650M 3B; ESM C shapes when named); "
                        "weights suite: of "
                        "650M 3B 15B (default: all three)")
    p.add_argument("--tune", action="store_true", help="weights suite: also time a grid of launch constants")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--quick", action="store_true", help="fewer sizes")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--reference", action="store_true", help="force the PyTorch reference paths")
    p.add_argument("--out", default=None, help="also write the result here (.json → JSON, else the tables)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="offline end-to-end run on a stand-in model: calibrate + evaluate")
    p.add_argument("--size", default="8M", choices=list(ESM2_SIZES),
                   help="the stand-in's ESM-2 shape")
    p.add_argument("--out", default="demo_output", help="folder for the stand-in model, checkpoints and report")
    p.add_argument("--calibration-fasta", default=str(CALIBRATION_DATA / "calibration.fasta"))
    p.add_argument("--eval-fasta", default=str(CALIBRATION_DATA / "evaluation.fasta"))
    p.add_argument("--limit", type=checks.int_in(1), default=12)
    p.add_argument("--max-steps", type=checks.int_in(1), default=32)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except EsmTurboError as err:  # the project's expected errors: one line naming what was given
        print(f"esm-turbo: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("esm-turbo: interrupted", file=sys.stderr)
        return 130
    except Exception:  # a bug: keep its traceback visible
        import traceback
        traceback.print_exc()
        print("esm-turbo: internal error (the traceback above); please report it with the command line you ran",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
