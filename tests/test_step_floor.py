"""The decode step's floor (what one step must read) and its breakdown by kernel kind (esm_turbo.bench.step)."""

import pytest
import torch

from esm_turbo.bench.step import (KINDS, OTHER, breakdown, floor_ms, format_breakdown, kernel_kind, launch_bytes,
                                  step_bytes, weight_bytes)
from esm_turbo.bench.synthetic import stand_in_model, synthetic_session
from esm_turbo.bench.timing import Product, launch_floors_us
from esm_turbo.model.engine import TurboEsm


@pytest.mark.parametrize("name, kind", [
    ("_stream_kernel", "attention"), ("_merge_kernel", "attention"), ("_blocks_kernel", "attention"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80", "attention"),  # cutlass in its name, attention all the same
    ("_quantize_pack_kernel", "cache write"),
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64", "linears"),
    ("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTT", "linears"), ("void cutlass::Kernel2<cutlass_80_tensorop>", "linears"),
    ("_gemv_kernel", "linears"), ("_dequant_matmul_kernel", "linears"), ("_rotate_kernel", "linears"),
    ("_add_ln_kernel", OTHER), ("_rope_kernel", OTHER),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", OTHER),
])
def test_each_kernel_has_one_kind(name, kind):
    assert kernel_kind(name) == kind
    assert kind == OTHER or kind in dict(KINDS)


def test_breakdown_counts_overlaps_once_and_the_gaps_between():
    kernels = [("_stream_kernel", 0.0, 10.0), ("gemm_a", 5.0, 20.0), ("_add_ln_kernel", 30.0, 35.0)]  # µs
    b = breakdown(kernels)
    assert b["launches"] == 3
    assert b["kinds_ms"]["attention"] == pytest.approx(0.010) and b["kinds_ms"]["linears"] == pytest.approx(0.015)
    assert b["kinds_ms"][OTHER] == pytest.approx(0.005) and b["kinds_ms"]["cache write"] == 0
    assert b["busy_ms"] == pytest.approx(0.025)  # 0-20 and 30-35
    assert b["span_ms"] == pytest.approx(0.035) and b["gaps_ms"] == pytest.approx(0.010)
    assert [t["name"] for t in b["top"]] == ["gemm_a", "_stream_kernel", "_add_ln_kernel"]
    assert b["top"][0]["kind"] == "linears" and b["top"][0]["calls"] == 1
    line = format_breakdown(b, step_ms=0.05)
    assert "3 kernels" in line and "GPU idle 0.03 ms" in line
    assert breakdown([])["launches"] == 0


def test_weight_bytes_are_the_layers_and_the_rows_embeddings():
    """ESM-2 layers hold 12·h² weights and a few vectors; the embedding table counts only the rows' tokens."""
    model = stand_in_model("8M", torch.device("cpu"), torch.float32)
    h, layers = model.config.hidden_size, model.config.num_hidden_layers
    none = weight_bytes(model, 0)
    assert weight_bytes(model, 5) - none == 5 * h * 4
    assert none == pytest.approx(4 * layers * 12 * h * h, rel=0.06)


def test_step_bytes_of_an_uncompressed_cache_are_every_rows_keys_and_values():
    model = stand_in_model("8M", torch.device("cpu"), torch.float32, layers=2)
    engine = TurboEsm(model)
    batch, context = 3, 40
    session = synthetic_session(engine, "fp32", batch, context, 4)
    h = model.config.hidden_size
    got = step_bytes(session)
    assert got["kv"] == batch * context * 2 * 2 * h * 4  # rows · tokens · layers · (K, V) · hidden · fp32
    assert got["activations"] == batch * h * 4 * 2
    assert got["weights"] == weight_bytes(model, batch)
    assert step_bytes(session, rows=1)["kv"] == got["kv"] // batch
    assert floor_ms(3 * 10**9, 3000.0) == pytest.approx(1.0)


def test_launch_bytes_are_ten_launches_a_layer_over_the_steps_bytes():
    """A fused step's launches, ten a layer: the attention reads the layer's keys and values, the four products their
    weights and biases (the layer's weights less its LayerNorms'), the rest the rows' hidden states."""
    model = stand_in_model("8M", torch.device("cpu"), torch.float32, layers=2)
    batch, context = 3, 40
    session = synthetic_session(TurboEsm(model), "fp32", batch, context, 4)
    h, f = model.config.hidden_size, model.config.intermediate_size
    sizes = launch_bytes(session)
    assert len(sizes) == 10 * 2
    assert sum(sizes[0::10]) == step_bytes(session)["kv"]
    layer = model.esm.encoder.layer[0]
    linears = sum(p.numel() * 4 for n, p in layer.named_parameters() if "LayerNorm" not in n)
    assert sum(sizes[2:6]) == linears == (4 * h * h + 2 * h * f + 5 * h + f) * 4
    assert sizes[1] == batch * 2 * h * 4  # the step's write of the new keys and values (an uncompressed cache)
    assert sizes[6:10] == [batch * 2 * h * 4, batch * f * 4, 2 * batch * h * 4, 2 * batch * h * 4]
    assert sizes[10:] == sizes[:10]  # every layer alike
    assert len(launch_bytes(session, rows=1)) == 20 and launch_bytes(session, rows=1)[0] == sizes[0] // batch
    from esm_turbo.bench.synthetic import layer_codec
    compressed = launch_bytes(synthetic_session(TurboEsm(model), layer_codec, batch, context, 4))
    assert compressed[1] == batch * h * 4 and compressed[0] < sizes[0]  # the merge's float32 partials; codes
    writing = launch_bytes(synthetic_session(TurboEsm(model), layer_codec, batch, context, 4), commit=True)
    assert len(writing) == 11 * 2 and writing[:10] == compressed[:10] and writing[10] == batch * 2 * h * 4
    assert launch_bytes(session, commit=True) == sizes  # an uncompressed cache writes in every step already


def test_launch_bytes_can_list_the_products_as_gemms_of_the_steps_shapes():
    """With ``products``, each layer's four products are launches of the step's rows by its weights' shapes (q/k/v
    stacked, out, FFN up, FFN down), the other launches' bytes unchanged; a product launch computes F.linear."""
    model = stand_in_model("8M", torch.device("cpu"), torch.float32, layers=2)
    batch = 3
    session = synthetic_session(TurboEsm(model), "fp32", batch, 40, 4)
    h, f = model.config.hidden_size, model.config.intermediate_size
    sizes, gemms = launch_bytes(session), launch_bytes(session, products="fp16")
    assert len(gemms) == len(sizes)
    assert [p for p in gemms if isinstance(p, Product)] == [Product(batch, 3 * h, h), Product(batch, h, h),
                                                            Product(batch, f, h), Product(batch, h, f)] * 2
    others = [n for i, n in enumerate(sizes) if i % 10 not in range(2, 6)]
    assert [n for n in gemms if not isinstance(n, Product)] == others
    assert all(p.fp8 for p in launch_bytes(session, products="fp8") if isinstance(p, Product))
    out = Product(batch, f, h).launch(torch.device("cpu"))()
    assert out.shape == (batch, f) and out.dtype == torch.float16 and torch.isfinite(out).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_decode_rows_gpu_hold_their_floor_and_breakdown():
    """Every row of the decode suite (CUDA) states its floor, which no step beats, and a profile with kernels of
    every kind a compressed step runs."""
    from esm_turbo.bench import bench_decode
    from esm_turbo.bench.report import BenchResult, format_result
    rows = bench_decode(torch.device("cuda"), "8M", context=256, budget_gib=0.05, steps=4, layers=2, batches=(4,))
    assert {r["cache"] for r in rows} == {"fp16", "turbo-3+1-lut", "turbo-3+1-grid"}
    assert sum(r["at_budget"] for r in rows) == 3 and len(rows) == 6
    for r in rows:
        assert 0 < r["of_floor"] <= 1.05 and r["floor_ms"] > 0
        assert r["floor_ms"] < r["launches_ms"] and r["launches_of_floor"] < 1  # launches add their fixed costs
        assert r["products_ms"] > 0.9 * r["launches_ms"] and r["products_of_floor"] < 1  # a product reads its weight
        assert r["breakdown"]["launches"] > 0
        kinds = r["breakdown"]["kinds_ms"]
        assert kinds["attention"] > 0 and kinds["linears"] > 0
        if r["cache"] != "fp16":
            assert kinds["cache write"] > 0
    assert "with cuBLAS's products" in format_result(BenchResult(device="cuda", decode=rows))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_a_step_with_cublas_products_takes_at_least_its_pure_reads_gpu():
    """The step's launches with its products as cuBLAS's (fp16) and FP8 products take no less than the same launches
    as pure reads: a product reads at least its weight."""
    dev = torch.device("cuda")
    model = stand_in_model("8M", dev, torch.float16, layers=2)
    session = synthetic_session(TurboEsm(model), "fp16", 16, 256, 4)
    reads = launch_floors_us(launch_bytes(session), dev)
    for kind in ("fp16", "fp8"):
        assert launch_floors_us(launch_bytes(session, products=kind), dev) > 0.9 * reads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_design_rows_gpu_hold_their_floor_and_captured_steps():
    """The design bench (CUDA) captures each cache's step, the paged one included, and profiles each eagerly."""
    from esm_turbo.bench.design import bench_design, format_design
    res = bench_design(torch.device("cuda"), "8M", prefix=64, candidates=8, tail=8, block_size=16, layers=2)
    assert [r["cache"] for r in res.rows] == ["compressed, paged", "compressed, contiguous", "fp16, contiguous"]
    for r in res.rows:
        assert r["captured_ms"] > 0 and 0 < r["captured_of_floor"] <= 1.05 and r["of_floor"] > 0
        assert r["breakdown"]["eager"] and r["breakdown"]["kinds_ms"]["attention"] > 0
    assert "captured as a CUDA graph" in format_design(res)
