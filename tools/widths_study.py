"""Study: how wide one channel of an allocation may be (PyTorch path, CPU), on a trained testbed as trained and with
function-preserving K/V outliers planted. Each spec is ``INDEX_BITS:KEY_CAP:VALUE_CAP[:GRID_SPAN]`` (index bits + a
sign bit all-in; a key cap of ``-`` is index bits + 1, the former default; a value cap of ``-`` follows the key cap;
the grid span, default the recipe's), e.g. ``2:-:-`` (values capped), ``2:-:6`` (the default), ``2:6:6`` (preset
``wide``), ``3:-:6:0.5`` (outer grid levels half way out to the calibration's extremes).

    python tools/widths_study.py ../shared/testbed/esm2_8M_trained --specs 2:-:- 2:-:6 2:6:6 --plant --out R.txt
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from esm_turbo import TurboEsm, calibrate
from esm_turbo.model.recipe import recipe
from esm_turbo.testing import plant_outliers
from study_common import data_flags, measure, parse, stream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", nargs="+", default=["2:-:-", "2:-:6", "2:6:6", "3:-:-", "3:-:6", "3:7:7"])
    ap.add_argument("--plant", action="store_true", help="also with K/V outliers planted (testing.plant_outliers)")
    args, model, cal_records, eval_records = parse(ap)
    lines = [f"# python tools/widths_study.py {args.model} --specs {' '.join(args.specs)}"
             + (" --plant" if args.plant else "")
             + data_flags(args),
             f"# {len(eval_records)} held-out sequences, half prefilled exactly, the rest decoded; PyTorch path, CPU",
             f"{'model':<11} {'index':>5} {'key cap':>7} {'value cap':>9} {'span':>4} {'all-in':>6} {'mean cos':>9} "
             f"{'worst seq':>9} {'worst tok':>9} {'<0.95':>7}"]
    for planted in ([False, True] if args.plant and not args.planted else [args.planted]):
        if planted and not args.planted:
            plant_outliers(model)
        for spec in args.specs:
            bits, key_cap, value_cap, *span = spec.split(":")
            cap = {c: None if c == "-" else int(c) for c in (key_cap, value_cap)}
            cfg = replace(recipe("default", index_bits=int(bits)), max_channel_bits=cap[key_cap],
                          max_value_channel_bits=cap[value_cap])
            cfg = replace(cfg, grid_span=float(span[0])) if span else cfg
            t0 = time.time()
            cal = calibrate(model, cal_records, cfg, progress=False)
            r = measure(TurboEsm(model, cal), eval_records, cal.codecs)
            lines.append(f"{'planted' if planted else 'as trained':<11} {bits:>5} {key_cap:>7} {value_cap:>9} "
                         f"{cfg.grid_span:>4.2f} "
                         f"{r['bits']:>6.2f} {r['mean']:>9.4f} {r['worst']:>9.4f} {r['token']:>9.4f} "
                         f"{r['tail']:>7.2%}")
            print(lines[-1], f"({time.time() - t0:.0f} s)", flush=True)
    stream(lines, args.out)


if __name__ == "__main__":
    main()
