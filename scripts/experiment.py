"""Run one experiment (or a Hydra multirun sweep); each run writes one result row.

    python scripts/experiment.py quant=tq35                       # one run
    python scripts/experiment.py -m quant=fp16,int4,turboesm      # a sweep, one row per method
    python scripts/report.py                                      # tables and plots from all rows

Rows land in results/rows/<sweep>/<model>/<quant>.json (``out=`` and ``sweep=`` change that).
"""

import hydra
from omegaconf import OmegaConf

from esm_turbo.experiments.config import ExperimentConf, register
from esm_turbo.experiments.runner import run_experiment

register()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg) -> None:
    exp: ExperimentConf = OmegaConf.to_object(cfg)
    row = run_experiment(exp)
    print(f"{row['model']:>16} {row['quant']:<22} {row['bits_per_value']:6.3f} bits/value  "
          f"decode cos {row['decode_cos_mean']:.4f} (worst seq {row['decode_cos_worst_seq']:.4f}, worst token "
          f"{row['decode_cos_min']:.4f}, {row['decode_tail_share']:.2%} under 0.95)  "
          f"top-1 {row['top1_agreement']:.3f}  attn err {row['attn_rel_err_mean']:.4f}")


if __name__ == "__main__":
    main()
