import os

import torch

# Without CUDA, Triton kernels run under Triton's interpreter; it must be on before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from esm_turbo.testing import save_stress_model, stress_esm2


@pytest.fixture(scope="session")
def stress_model():
    """A 4-layer, 64-wide, 4-head stress ESM-2 (head_dim 16) with planted outliers."""
    return stress_esm2(layers=4, hidden=64, heads=4, seed=0)


@pytest.fixture(scope="session")
def stress_dir(tmp_path_factory):
    """The same kind of model written with save_pretrained (+ a fair-esm model.pt)."""
    return save_stress_model(tmp_path_factory.mktemp("stress"), layers=3, hidden=64, heads=4, seed=1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
