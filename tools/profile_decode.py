"""Profile one eager decode step of a 650M-shaped model (random weights, synthetic 1K context) with the
compressed cache: which kernels take the step's time (GPU). Prints torch.profiler's table."""

import torch
from torch.profiler import ProfilerActivity, profile

from esm_turbo.bench.synthetic import default_codec, stand_in_model as _model, synthetic_session
from esm_turbo.model.alphabet import alphabet
from esm_turbo.model.engine import TurboEsm


@torch.no_grad()
def main(batch: int = 195, context: int = 1024):
    dev = torch.device("cuda")
    engine = TurboEsm(_model("650M", dev, torch.float16))
    session = synthetic_session(engine, lambda i, h, d: default_codec(h, d, seed=i),
                                batch, context, 8)
    tokens = torch.full((batch, 1), alphabet().get_idx("A"), device=dev)
    for _ in range(2):
        session.step(tokens, commit=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        session.step(tokens, commit=True)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
