"""Container layout, eligibility and the validator (format section 4); quantiser input checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_s3d8 import (
    S3D8FormatError,
    S3D8IneligibleError,
    S3D8InputError,
    body_offset,
    dequantize_s3d8,
    quantize_s3d8,
    quantize_s3d8_with_codebook,
    read_container,
    s3d8_ineligibility,
    write_container,
)
from gguf_s3d8.packing import pack_bytes

K = 2048
N = 248  # n % 3 == 2 (smallest eligible at k = 2048): the last triple has one padding row
P = -(-N // 3)


def smallest_eligible(k: int, residue: int) -> int:
    return next(n for n in range(residue or 3, 100000, 3) if s3d8_ineligibility(n, k) is None)


def test_smallest_eligible_n_table_from_the_format_page() -> None:
    table = {1024: (192, 1216, 704), 2048: (48, 448, 248), 4096: (18, 334, 176)}
    for k, expected in table.items():
        got = tuple(smallest_eligible(k, r) for r in (0, 1, 2))
        assert got == expected, k
        for n in expected:                       # and the one just below each is rejected
            assert s3d8_ineligibility(n - 3, k) is not None


@pytest.mark.parametrize("n, k, fragment", [
    (48, 2000, "not a multiple of 128"),
    (47, 2048, "too small"),
    (0, 2048, "empty"),
    (3, 128, "too small"),
])
def test_ineligibility_reasons(n: int, k: int, fragment: str) -> None:
    reason = s3d8_ineligibility(n, k)
    assert reason is not None and fragment in reason


def test_eligible_llama_shapes() -> None:
    for n, k in [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096), (1280, 1280)]:
        assert s3d8_ineligibility(n, k) is None
    assert s3d8_ineligibility(1280, 588) is not None     # the patch embedding


def parts(seed: int, n: int = N, k: int = K) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    cb = rng.integers(0, 128, size=(32, 3)).astype(np.uint8)
    scales = rng.integers(0x3000, 0x4000, size=n).astype(np.uint16)
    p = -(-n // 3)
    q = rng.integers(0, 32, size=(p, k)).astype(np.uint8)
    s = rng.random(size=(3, p, k)) < 0.5
    s[n % 3 or 3:, -1] = False                  # padding rows: S = 0
    return cb, scales, pack_bytes(q, s[0], s[1], s[2])


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([(48, 2048), (448, 2048), (248, 2048), (18, 4096)]))
def test_write_read_round_trip(seed: int, shape: tuple[int, int]) -> None:
    n, k = shape
    cb, scales, packed = parts(seed, n, k)
    c = write_container(k, n, cb, scales, packed, name="t")
    assert c.shape == (n, 43 * k // 128) and c.dtype == np.uint8
    r = read_container(c, name="t")
    assert (r.k, r.n) == (k, n)
    assert np.array_equal(r.codebook, cb) and np.array_equal(r.scales_bf16, scales)
    assert np.array_equal(r.packed, packed)
    flat = c.reshape(-1)
    assert bytes(flat[:4]) == b"S3D8" and flat[4] == 1
    assert int.from_bytes(bytes(flat[8:12]), "little") == k and int.from_bytes(bytes(flat[12:16]), "little") == n
    assert np.array_equal(flat[16:112].reshape(32, 3), cb)
    assert np.array_equal(flat[128:128 + 2 * n].view("<u2"), scales)
    b = body_offset(n)
    assert b % 64 == 0 and b >= 128 + 2 * n
    assert np.array_equal(flat[b:b + packed.size].reshape(packed.shape), packed)
    assert read_container(bytes(flat), name="t").n == n           # flat bytes work too


@pytest.fixture()
def good() -> np.ndarray:
    cb, scales, packed = parts(1)
    return write_container(K, N, cb, scales, packed).reshape(-1).copy()


def corrupt(buf: np.ndarray, offset: int, value: int) -> np.ndarray:
    out = buf.copy()
    out[offset] = value
    return out


def bf16_at(buf: np.ndarray, row: int, bits: int) -> np.ndarray:
    out = buf.copy()
    out[128 + 2 * row:130 + 2 * row] = np.array([bits], "<u2").view(np.uint8)
    return out


def u32_at(buf: np.ndarray, offset: int, value: int) -> np.ndarray:
    out = buf.copy()
    out[offset:offset + 4] = np.array([value], "<u4").view(np.uint8)
    return out


@pytest.mark.parametrize("mutate, fragment", [
    (lambda b: corrupt(b, 0, ord("X")), "bad magic"),
    (lambda b: corrupt(b, 3, ord("9")), "bad magic"),
    (lambda b: corrupt(b, 4, 2), "version 2"),
    (lambda b: corrupt(b, 4, 0), "version 0"),
    (lambda b: corrupt(b, 5, 1), "reserved"),
    (lambda b: corrupt(b, 7, 0x80), "reserved"),
    (lambda b: u32_at(b, 8, K + 128), "needs"),
    (lambda b: u32_at(b, 8, 2000), "not a multiple of 128"),
    (lambda b: u32_at(b, 12, N + 1), "needs"),
    (lambda b: u32_at(b, 12, 0), "empty"),
    (lambda b: u32_at(b, 12, 3), "too small"),
    (lambda b: corrupt(b, 16, 128), r"C\[0\]\[0\] = 128"),
    (lambda b: corrupt(b, 16 + 3 * 31 + 2, 255), r"C\[31\]\[2\] = 255"),
    (lambda b: corrupt(b, 112, 1), "after the codebook"),
    (lambda b: corrupt(b, 127, 1), "after the codebook"),
    (lambda b: bf16_at(b, 0, 0x7FC0), "row 0 is not finite"),
    (lambda b: bf16_at(b, N - 1, 0x7F80), f"row {N - 1} is not finite"),
    (lambda b: bf16_at(b, 3, 0xFF80), "row 3 is not finite"),
    (lambda b: bf16_at(b, 5, 0xBF80), "row 5 is negative"),
    (lambda b: bf16_at(b, 5, 0x8000), "row 5 is negative"),
    (lambda b: corrupt(b, 128 + 2 * N, 1), "between scales and body"),
    (lambda b: corrupt(b, body_offset(N) - 1, 1), "between scales and body"),
    (lambda b: b[:-1], "needs"),
    (lambda b: b[:100], "shorter than the 128-byte header"),
    (lambda b: b[:0], "shorter"),
    (lambda b: np.concatenate([b, np.zeros(43 * 16, np.uint8)]), "needs"),
])
def test_validator_rejects_corruption_naming_the_tensor(good: np.ndarray, mutate, fragment: str) -> None:
    read_container(good, name="blk.3.ffn_up.weight")
    with pytest.raises(S3D8FormatError, match=fragment) as info:
        read_container(mutate(good), name="blk.3.ffn_up.weight")
    assert "'blk.3.ffn_up.weight'" in str(info.value)


def test_validator_rejects_bytes_after_the_body() -> None:
    n = 51                                        # 16 bytes of slack after the body at k = 2048
    cb, scales, packed = parts(3, n)
    c = write_container(K, n, cb, scales, packed).reshape(-1)
    end = body_offset(n) + 17 * K
    assert c.size - end == 16
    read_container(c, name="t")
    for offset in (end, c.size - 1):
        with pytest.raises(S3D8FormatError, match=f"'t'.*after the packed body.*byte {offset}"):
            read_container(corrupt(c, offset, 7), name="t")


def test_validator_rejects_negative_padding_signs(good: np.ndarray) -> None:
    last = body_offset(N) + (N // 3) * K          # first byte of the last triple
    b = corrupt(good, last + 5, good[last + 5] ^ 0x80)   # flip S2 of the (padding) row 3p+2
    with pytest.raises(S3D8FormatError, match="padding row.*column 5"):
        read_container(b, name="x")
    # with n % 3 == 1 both S1 and S2 are padding
    cb, scales, packed = parts(2, 448)
    c = write_container(K, 448, cb, scales, packed).reshape(-1)
    last = body_offset(448) + 149 * K
    with pytest.raises(S3D8FormatError, match="padding row"):
        read_container(corrupt(c, last, c[last] | 0x40), name="x")


def test_validator_checks_the_gguf_shape(good: np.ndarray) -> None:
    with pytest.raises(S3D8FormatError, match="shape"):
        read_container(good.reshape(N // 2, -1), name="x")
    with pytest.raises(S3D8FormatError, match="uint8"):
        read_container(good.view(np.int8), name="x")
    with pytest.raises(S3D8FormatError, match="unnamed"):
        read_container(corrupt(good, 0, 0))


def test_read_views_are_read_only(good: np.ndarray) -> None:
    r = read_container(good)
    with pytest.raises(ValueError):
        r.packed[0, 0] = 1


def test_quantiser_rejects_bad_input_naming_the_tensor() -> None:
    w = np.ones((48, 2048), np.float32)
    cb = np.zeros((32, 3), np.uint8)
    for bad in (np.nan, np.inf, -np.inf):
        ww = w.copy()
        ww[7, 9] = bad
        with pytest.raises(S3D8InputError, match=r"'blk.0.attn_q.weight'.*non-finite.*\(7, 9\)"):
            quantize_s3d8_with_codebook(ww, cb, name="blk.0.attn_q.weight")
        with pytest.raises(S3D8InputError, match="non-finite"):
            quantize_s3d8(ww, name="blk.0.attn_q.weight")
    with pytest.raises(S3D8IneligibleError, match=r"'v.patch_embd'.*k=588.*multiple of 128"):
        quantize_s3d8(np.ones((1280, 588), np.float32), name="v.patch_embd")
    with pytest.raises(S3D8IneligibleError, match=r"'tiny'.*too small"):
        quantize_s3d8_with_codebook(np.ones((47, 2048), np.float32), cb, name="tiny")
    with pytest.raises(S3D8InputError, match="2-D"):
        quantize_s3d8_with_codebook(np.ones(2048, np.float32), cb, name="v")
    with pytest.raises(S3D8InputError, match="floating"):
        quantize_s3d8_with_codebook(np.ones((48, 2048), np.int32), cb, name="v")
    for bad_cb, fragment in ((np.full((32, 3), 128), "0..127"), (np.zeros((31, 3)), "shape"),
                             (np.full((32, 3), 1.5), "integers")):
        with pytest.raises(S3D8InputError, match=fragment):
            quantize_s3d8_with_codebook(w, bad_cb, name="v")


def test_expert_stack_round_trip() -> None:
    rng = np.random.default_rng(4)
    w = rng.normal(size=(2, 48, 2048)).astype(np.float32)
    c = quantize_s3d8(w, name="ffn_up_exps")
    assert c.shape == (2, 48, 688)
    for e in range(2):
        assert np.array_equal(c[e], quantize_s3d8(w[e], name="x"))
    d = dequantize_s3d8(c)
    assert d.shape == w.shape and np.array_equal(d[1], dequantize_s3d8(c[1]))
    bad = c.copy()
    bad[1, 0, 0] = 0
    with pytest.raises(S3D8FormatError, match=r"'ffn_up_exps\[1\]'"):
        dequantize_s3d8(bad, name="ffn_up_exps")
