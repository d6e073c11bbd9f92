"""Byte layout, sign rule and table decoding (format section 2)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_s3d8.packing import decode_bytes, decode_tables, pack_bytes, sign_bits, unpack_bytes


def test_every_byte_unpacks_and_repacks() -> None:
    b = np.arange(256, dtype=np.uint8)
    q, s0, s1, s2 = unpack_bytes(b)
    assert np.array_equal(pack_bytes(q, s0, s1, s2), b)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 31), st.booleans(), st.booleans(), st.booleans())
def test_bit_layout(q: int, s0: bool, s1: bool, s2: bool) -> None:
    b = int(pack_bytes(np.array([q], np.uint8), np.array([s0]), np.array([s1]), np.array([s2]))[0])
    assert b == int(s0) | (q << 1) | (int(s1) << 6) | ((int(s0) ^ int(s2)) << 7)
    assert b & 1 == s0 and (b >> 1) & 31 == q and (b >> 6) & 1 == s1 and ((b >> 7) ^ b) & 1 == s2
    uq, u0, u1, u2 = unpack_bytes(np.array([b], np.uint8))
    assert (int(uq[0]), bool(u0[0]), bool(u1[0]), bool(u2[0])) == (q, s0, s1, s2)


def test_pack_rejects_index_32() -> None:
    f = np.array([False])
    with pytest.raises(ValueError):
        pack_bytes(np.array([32], np.uint8), f, f, f)


def test_sign_rule_negative_zero_is_positive() -> None:
    v = np.array([-0.0, 0.0, -1e-45, 1e-45, -3.0, np.float32(-0.0) * 5], dtype=np.float32)
    assert sign_bits(v).tolist() == [False, False, True, False, True, False]


def test_tables_layout() -> None:
    cb = np.arange(96, dtype=np.uint8).reshape(32, 3)
    l0, l1, l2 = decode_tables(cb)
    assert l0.dtype == l1.dtype == l2.dtype == np.int8 and l0.shape == l1.shape == l2.shape == (64,)
    for l in range(32):
        assert (l0[2 * l], l0[2 * l + 1]) == (cb[l, 0], -int(cb[l, 0]))
        assert (l1[l], l1[32 + l]) == (cb[l, 1], -int(cb[l, 1]))
        assert (l2[2 * l], l2[2 * l + 1]) == (cb[l, 2], -int(cb[l, 2]))


def test_127_negates_without_overflow() -> None:
    l0, l1, l2 = decode_tables(np.full((32, 3), 127, np.uint8))
    assert l0.min() == l1.min() == l2.min() == -127


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_table_decode_equals_direct_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cb = rng.integers(0, 128, size=(32, 3)).astype(np.uint8)
    b = np.arange(256, dtype=np.uint8)
    w0, w1, w2 = decode_bytes(b, decode_tables(cb))
    q, s0, s1, s2 = unpack_bytes(b)
    for d, (w, s) in enumerate(((w0, s0), (w1, s1), (w2, s2))):
        direct = np.where(s, -cb[q, d].astype(np.int16), cb[q, d].astype(np.int16))
        assert np.array_equal(w.astype(np.int16), direct)
