"""GPTQ (qat/gptq.py): identity Hessian = direct cast bit for bit, lower output error than a direct cast for
every format, S3D8 output packable into a real container, damping increase, Hessian capture and sharing,
and every Linear of a small mllama (vision, cross-attention, projector, lm_head) quantised."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from qat.formats import IntFormat, LloydMaxFormat, S3D8Format, StudentTFormat, WeightFormat, direct_cast
from qat.gptq import (HessianCollector, collect_hessians, group_aware_order, gptq_quantise, inverse_hessian_factor,
                      linear_modules, quantise_model)

FORMATS: dict[str, WeightFormat] = {
    "int6_g32": IntFormat(6, 32),
    "int4_g128_affine": IntFormat(4, 128, affine=True),
    "int8_g64_affine": IntFormat(8, 64, affine=True),
    "studentt6_g64": StudentTFormat(6, 64),
    "lloydmax6": LloydMaxFormat(6),
    "s3d8": S3D8Format(),
}


def _weights(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.distributions.StudentT(5.0).sample((rows, k)) * 0.02 + 0.0 * torch.randn(1, generator=g)


def _inputs(n: int, k: int, seed: int) -> torch.Tensor:
    """Correlated activations with outlier channels (what makes GPTQ worth it)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, k // 8, generator=g) @ torch.randn(k // 8, k, generator=g)
    x = base + 0.3 * torch.randn(n, k, generator=g)
    return x * (1 + 4 * torch.rand(k, generator=g) ** 4)


@pytest.mark.parametrize("fid", list(FORMATS))
def test_identity_hessian_equals_direct_cast(fid: str) -> None:
    torch.manual_seed(0)
    w = _weights(48, 256, 1)
    fmt = FORMATS[fid]
    q, stats = gptq_quantise(w, torch.eye(256), fmt.quantiser(w))
    assert torch.equal(q, fmt.quantise(w))
    assert stats.damp == 0.05 and stats.cholesky_failures == 0 and stats.dead_columns == 0


@pytest.mark.parametrize("fid", list(FORMATS))
def test_gptq_reduces_output_error(fid: str) -> None:
    torch.manual_seed(0)
    w = _weights(96, 256, 2)
    x = _inputs(1024, 256, 3)
    h = 2 * x.T @ x / x.shape[0]
    fmt = FORMATS[fid]
    q, _ = gptq_quantise(w, h, fmt.quantiser(w))
    err_gptq = (x @ (w - q).T).norm()
    err_direct = (x @ (w - fmt.quantise(w)).T).norm()
    assert err_gptq < 0.9 * err_direct, (fid, float(err_gptq), float(err_direct))


def test_s3d8_gptq_output_is_a_valid_container() -> None:
    import gguf_s3d8

    n, k = 192, 1024  # eligible: k % 128 == 0, n % 3 == 0, n >= 192
    w = _weights(n, k, 4)
    x = _inputs(2048, k, 5)
    quantiser = S3D8Format().quantiser(w)
    q, _ = gptq_quantise(w, 2 * x.T @ x / x.shape[0], quantiser)
    # the direct cast stores the same codebook and scales
    direct = gguf_s3d8.read_container(gguf_s3d8.quantize_s3d8(w.numpy(), centroid_rule=S3D8Format().rule))
    assert np.array_equal(direct.codebook, quantiser.codebook)
    assert np.array_equal(direct.scales_bf16, quantiser.scales_bf16)
    # every row triple of every column is +-centroid x bf16 row scale: packing it under the fixed codebook
    # and scales and decoding the container gives the GPTQ output back exactly
    container = quantiser.container(quantiser.pack(q.numpy()))
    assert container.shape == (n, 43 * k // 128)
    np.testing.assert_array_equal(gguf_s3d8.dequantize_s3d8(container), q.numpy())
    assert not torch.equal(q, torch.from_numpy(gguf_s3d8.dequantize_s3d8(gguf_s3d8.quantize_s3d8(w.numpy()))))


def test_damping_increases_until_cholesky_succeeds() -> None:
    h = torch.diag(torch.tensor([1.0, 1.0, 1.0, -0.05]))  # mean diag 0.7375: 0.05, 0.06 fail, 0.07 works
    u, damp, failures = inverse_hessian_factor(h)
    assert failures == 2 and damp == pytest.approx(0.07)
    h_damped = h.double() + damp * 0.7375 * torch.eye(4, dtype=torch.float64)
    assert torch.allclose(u.T @ u, torch.linalg.inv(h_damped), atol=1e-10)
    w = _weights(6, 4, 6)
    _, stats = gptq_quantise(w, h, IntFormat(16, 4).quantiser(w))
    assert stats.cholesky_failures == 2 and stats.damp == pytest.approx(0.07)


def test_dead_columns_are_zeroed() -> None:
    w = _weights(8, 64, 7)
    x = _inputs(256, 64, 8)
    x[:, 5] = 0
    q, stats = gptq_quantise(w, 2 * x.T @ x / 256, IntFormat(16, 32).quantiser(w))
    assert stats.dead_columns == 1 and torch.all(q[:, 5] == 0)


def test_group_aware_order() -> None:
    d = torch.tensor([1.0, 5.0, 2.0, 0.5, 9.0, 3.0, 0.1, 0.2])
    # groups of 4: [1,5,2,.5] max 5 -> order 1,2,0,3;  [9,3,.1,.2] max 9 -> order 4,5,7,6; group 2 first
    assert group_aware_order(d, 4).tolist() == [4, 5, 7, 6, 1, 2, 0, 3]
    assert group_aware_order(torch.ones(10), 4).tolist() == list(range(10))
    assert group_aware_order(d, 8).tolist() == torch.argsort(d, descending=True, stable=True).tolist()


def test_collect_hessians_shares_and_matches_hand_computation() -> None:
    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.o = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4), torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o(self.q(x) * self.k(x))

    model = Toy()
    xs = [torch.randn(2, 5, 8), torch.randn(1, 3, 8)]
    hs = collect_hessians(model, [{"x": x} for x in xs])
    assert hs["q"] is hs["k"] and hs["q"] is not hs["o"]
    flat = torch.cat([x.reshape(-1, 8) for x in xs]).double()
    assert hs["q"].n == 13
    assert torch.allclose(hs["q"].hessian().double(), 2 * flat.T @ flat / 13, atol=1e-6)
    with torch.no_grad():
        mid = torch.cat([(model.q(x) * model.k(x)).reshape(-1, 4) for x in xs]).double()
    assert torch.allclose(hs["o"].hessian().double(), 2 * mid.T @ mid / 13, atol=1e-6)


def _small_mllama():
    """The tiny mllama recipe of fixtures/tiny_model.py, shrunk for speed (same module structure)."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    from tests.mllama import tiny_model as T

    cfg = copy.deepcopy(T.TINY_CONFIG)
    cfg.pop("architectures")
    cfg["text_config"].update(hidden_size=96, intermediate_size=128, num_attention_heads=3, num_key_value_heads=1,
                              num_hidden_layers=4, cross_attention_layers=[1, 3])
    cfg["vision_config"].update(hidden_size=64, attention_heads=2, intermediate_size=128, vision_output_dim=192)  # hidden x (1 + 2 intermediate layers)
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(MllamaConfig(**cfg)).eval()
    T._randomise(model, 0)
    return model, T


def test_every_mllama_linear_is_gptq_quantised() -> None:
    model, T = _small_mllama()
    seq = 12
    ids = torch.randint(0, T.N_BPE, (1, seq))
    ids[0, 1] = T.IMAGE_TOKEN_ID
    tiles = 4
    batch = {
        "input_ids": ids,
        "pixel_values": torch.randn(1, 1, tiles, 3, T.IMAGE_SIZE, T.IMAGE_SIZE),
        "aspect_ratio_ids": torch.tensor([[6]]),  # 2 x 2 tiles
        "aspect_ratio_mask": torch.ones(1, 1, tiles, dtype=torch.long),
        "cross_attention_mask": torch.cat([torch.zeros(1, 1, 1, tiles), torch.ones(1, seq - 1, 1, tiles)], 1).long(),
    }
    linears = linear_modules(model)
    kinds = {"vision_model", "cross_attn", "multi_modal_projector", "lm_head", "self_attn", "mlp"}
    assert all(any(kd in n for n in linears) for kd in kinds)
    before = {n: m.weight.detach().clone() for n, m in linears.items()}
    hs = collect_hessians(model, [batch])
    assert all(hs[n].n > 0 for n in linears), [n for n in linears if hs[n].n == 0]
    # the projector's input holds the vision encoder's intermediate taps: Meta's (layer inputs), as in llama.cpp
    from qat.mllama_hf import meta_taps

    (proj,) = [n for n in linears if "multi_modal_projector" in n]
    seen: dict[str, torch.Tensor] = {}
    handle = linears[proj].register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0].detach().clone()))
    with torch.no_grad(), meta_taps():
        model(**batch)
    handle.remove()
    want = HessianCollector(seen["x"].shape[-1])
    want.add(seen["x"])
    assert torch.equal(hs[proj].xtx, want.xtx)
    report = quantise_model(model, IntFormat(16, 32), method="gptq", hessians=hs)
    assert set(report.gptq) == set(linears)
    embeddings = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    assert set(report.direct) == embeddings
    for n, m in linears.items():
        assert not torch.equal(m.weight, before[n]) and torch.isfinite(m.weight).all(), n
    with torch.no_grad():
        assert torch.isfinite(model(**batch).logits).all()
    assert 4.0 < report.bits_per_param < 5.0


def test_quantise_model_tied_lm_head_direct_cast() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    w_emb = model.model.embed_tokens.weight.detach().clone()
    report = quantise_model(model, IntFormat(6, 32), method="direct")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, IntFormat(6, 32).quantise(w_emb))
    assert "model.embed_tokens" not in report.direct and "lm_head" in report.direct
    assert report.params == sum(m.weight.numel() for m in linear_modules(model).values())


def test_direct_cast_helper_equals_format_quantise() -> None:
    w = _weights(10, 200, 9)  # ragged last block
    for fmt in (IntFormat(6, 64), IntFormat(12, 64, affine=True), StudentTFormat(8, 32), LloydMaxFormat(4)):
        assert torch.equal(direct_cast(fmt.quantiser(w), w), fmt.quantise(w))


def test_sequential_gptq_covers_every_linear_and_uses_quantised_inputs() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from qat.gptq import gptq_sequential, layer_stages

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    stages = layer_stages(model)
    assert [len(s) for s in stages] == [7, 7, 1] and stages[-1] == ["lm_head"]
    batches = [{"input_ids": torch.randint(0, 64, (1, 16))} for _ in range(3)]
    one_shot = collect_hessians(model, batches)
    early = collect_hessians(model, batches, modules={n: linear_modules(model)[n] for n in stages[0]}, stop_early=True)
    assert torch.equal(early["model.layers.0.mlp.down_proj"].xtx, one_shot["model.layers.0.mlp.down_proj"].xtx)
    seq_model = copy.deepcopy(model)
    report = gptq_sequential(seq_model, IntFormat(4, 32), batches)
    assert set(report.gptq) == set(linear_modules(model)) and report.direct == []
    # layer 0 saw the same inputs in both schemes; layer 1's inputs came from the quantised layer 0
    ref = copy.deepcopy(model)
    quantise_model(ref, IntFormat(4, 32), method="gptq", hessians=one_shot)
    w0 = "model.layers.0.self_attn.q_proj"
    assert torch.equal(dict(seq_model.named_modules())[w0].weight, dict(ref.named_modules())[w0].weight)
    w1 = "model.layers.1.self_attn.q_proj"
    assert not torch.equal(dict(seq_model.named_modules())[w1].weight, dict(ref.named_modules())[w1].weight)
