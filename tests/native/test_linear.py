"""Dense linears on the expert kernels (tandem_native.Linear): every variant and format against
generic and the float product, shapes that need padding, stored codes, batch invariance, bad input."""

import numpy as np
import pytest

from tests.native.test_kernels import ALL_ISAS, TOLERANCE
from tests.reference.moe import relative_error

tn = pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

# (out, in): tile-aligned; rows and columns that need padding (kv_a_proj's 40 rows, a 72-column
# input); one output (a shared-expert gate); a wide lm_head-like matrix
SHAPES = [(256, 128), (40, 64), (100, 72), (1, 64), (1056, 96)]


@pytest.fixture(scope="module")
def pool():
    return tn.ThreadPool(2)


def weight(rng, out, inp):
    return rng.standard_normal((out, inp), dtype=np.float32) / inp**0.5


def forward(lin, x, pool, isa=""):
    out = np.full((x.shape[0], lin.out_features), np.nan, dtype=np.float32)  # poisoned
    lin.forward(x, out, pool, isa)
    assert np.isfinite(out).all()
    return out


def packed(fmt, w, pool, bias=None):
    lin = tn.Linear(fmt, *w.shape)
    lin.pack(w, pool)
    if bias is not None:
        lin.set_bias(bias)
    return lin


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("fmt", list(TOLERANCE))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_variant_matches_generic_and_the_float_product(isa, fmt, shape, pool):
    if isa not in tn.supported_isas():
        pytest.skip(f"{isa}: not supported by this CPU or build (supported: {tn.supported_isas()})")
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    w = weight(rng, *shape)
    b = rng.standard_normal(shape[0], dtype=np.float32)
    lin = packed(fmt, w, pool, b)
    deq = lin.dequantize()
    for tokens in (1, 3, 40):  # scored over 40 tokens' worth each (one output of one token is noise)
        x = rng.standard_normal((40 // tokens, tokens, shape[1]), dtype=np.float32)
        ours = np.concatenate([forward(lin, xi, pool, isa) for xi in x])
        generic = np.concatenate([forward(lin, xi, pool, "generic") for xi in x])
        x = x.reshape(-1, shape[1])
        assert relative_error(ours, generic) <= 1e-4
        assert relative_error(ours - b, x @ w.T) <= TOLERANCE[fmt]
        # what is left against the packed weights themselves is the activations' rounding
        assert relative_error(ours - b, x @ deq.T) <= (1e-5 if fmt == "bf16" else 0.02)


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("fmt", list(TOLERANCE))
@pytest.mark.parametrize("inp", [128, 96])  # int8: 4 and 3 blocks of 32 (an odd count ends a tile loop alone)
# 1104: tasks of 8 tiles (runs of 2), the last of 5 (runs of 1, then a tile alone); 2000: tasks of
# 16 tiles (runs of 4), the last of 13 (runs of 3, then a tile alone)
@pytest.mark.parametrize("out", [100, 1104, 2000])
def test_a_token_gets_the_same_bits_alone_or_in_any_batch(isa, fmt, inp, out, pool):
    """Each token's output bits do not depend on its batch-mates, on every variant (bf16 on AMX
    takes the tiles at every size for this: they round otherwise than its SIMD path); a lone token
    reads runs of tiles side by side where its variant does (kDecodeStreams)."""
    if isa not in tn.supported_isas():
        pytest.skip(f"{isa}: not supported by this CPU or build (supported: {tn.supported_isas()})")
    rng = np.random.default_rng(3)
    lin = packed(fmt, weight(rng, out, inp), pool)
    x = rng.standard_normal((40, inp), dtype=np.float32)
    full = forward(lin, x, pool, isa)
    for start, n in ((0, 1), (7, 1), (3, 2), (10, 5), (0, 16), (0, 17), (20, 20), (39, 1)):
        assert np.array_equal(forward(lin, x[start:start + n].copy(), pool, isa), full[start:start + n]), (start, n)


def test_results_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(4)
    w, x = weight(rng, 1056, 96), rng.standard_normal((33, 96), dtype=np.float32)
    one, four = tn.ThreadPool(1), tn.ThreadPool(4)
    for fmt in TOLERANCE:
        assert np.array_equal(forward(packed(fmt, w, one), x, one), forward(packed(fmt, w, four), x, four))


def test_rows_packed_in_parts_equal_rows_packed_at_once(pool):
    """Stacked linears (q, k and v as one) are packed part by part at row offsets."""
    rng = np.random.default_rng(5)
    w = weight(rng, 100, 64)
    for fmt in TOLERANCE:
        parts = tn.Linear(fmt, 100, 64)
        parts.pack(w[:36].copy(), pool, 0)
        parts.pack(w[36:].copy(), pool, 36)
        assert np.array_equal(parts.dequantize(), packed(fmt, w, pool).dequantize())


def test_put_codes_stores_codes_and_scales_as_they_are(pool):
    rng = np.random.default_rng(6)
    out, inp = 48, 128
    for fmt, top in (("int8", 256), ("int4", 16), ("int4_asym", 16)):
        lin = tn.Linear(fmt, out, inp, 32, list(range(-8, 8)) if fmt == "int4" else None)
        codes = rng.integers(0, top, (out, inp), dtype=np.uint8)
        scales = rng.uniform(0.01, 1, (out, inp // 32)).astype(np.float16)
        mins = rng.uniform(-1, 0, (out, inp // 32)).astype(np.float16) if fmt == "int4_asym" else None
        lin.put_codes(0, codes[:20].copy(), scales[:20].copy().view(np.uint16),
                      None if mins is None else mins[:20].copy().view(np.uint16))
        lin.put_codes(20, codes[20:].copy(), scales[20:].copy().view(np.uint16),
                      None if mins is None else mins[20:].copy().view(np.uint16))
        levels = codes.view(np.int8) if fmt == "int8" else codes.astype(np.int8) - (8 if fmt == "int4" else 0)
        want = levels.astype(np.float32) * np.repeat(scales.astype(np.float32), 32, axis=1)
        if mins is not None:
            want += np.repeat(mins.astype(np.float32), 32, axis=1)
        assert np.array_equal(lin.dequantize(), want)
        x = rng.standard_normal((2, inp), dtype=np.float32)
        assert relative_error(forward(lin, x, pool), x @ want.T) <= 0.02


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_bf16_rows_of_exactly_bf16_values_get_the_same_bits_on_either_path(isa, pool):
    """A token whose activations are exactly bf16 (a bfloat16 dense path's) has no low parts: the
    vdpbf16ps kernels skip their products where every token of a tile group is such a token. Its
    bits are the same either way: alone, among its kind, or beside a token that has low parts."""
    if isa not in tn.supported_isas():
        pytest.skip(f"{isa}: not supported by this CPU or build (supported: {tn.supported_isas()})")
    rng = np.random.default_rng(7)
    lin = packed("bf16", weight(rng, 100, 128), pool)
    x = rng.standard_normal((20, 128), dtype=np.float32)
    exact = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # bf16 values, as float32
    mixed = exact.copy()
    mixed[5] = x[5]
    full = forward(lin, mixed, pool, isa)
    for rows in (exact, mixed):
        assert np.array_equal(forward(lin, rows, pool, isa)[:5], full[:5])
    for i in (0, 3, 19):
        assert np.array_equal(forward(lin, exact[i:i + 1].copy(), pool, isa)[0], full[i])
    assert relative_error(full, forward(lin, mixed, pool, "generic")) <= 1e-4


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_linears_of_one_input_in_one_call_equal_each_called_alone(tokens, pool):
    """A query projection in int4 beside key/value ones in int8 (and a padded part with a bias): one
    linears_forward call writes each part's bits into its column range."""
    rng = np.random.default_rng(tokens)
    parts = [packed("int4", weight(rng, 96, 64), pool), packed("int8", weight(rng, 40, 64), pool),
             packed("bf16", weight(rng, 100, 64), pool, rng.standard_normal(100, dtype=np.float32))]
    x = rng.standard_normal((tokens, 64), dtype=np.float32)
    out = np.full((tokens, 236), np.nan, dtype=np.float32)
    tn.linears_forward(parts, x, out, pool)
    assert np.array_equal(out, np.concatenate([forward(p, x, pool) for p in parts], axis=1))
    with pytest.raises(ValueError, match="out"):
        tn.linears_forward(parts, x, out[:, :235].copy(), pool)
    with pytest.raises(ValueError, match="in_features"):
        tn.linears_forward([parts[0], packed("int8", weight(rng, 16, 32), pool)], x, out, pool)
    with pytest.raises(ValueError, match="at least one"):
        tn.linears_forward([], x, out, pool)


def test_zero_tokens_is_a_no_op(pool):
    lin = packed("int8", weight(np.random.default_rng(7), 64, 64), pool)
    forward(lin, np.zeros((0, 64), np.float32), pool)


def test_bad_arguments_raise_value_errors_naming_them(pool):
    lin = packed("int4", weight(np.random.default_rng(8), 64, 64), pool)
    x = np.zeros((2, 64), np.float32)
    cases = [
        (lambda: tn.Linear("int5", 64, 64), "fmt"),
        (lambda: tn.Linear("int8", 0, 64), "out_features"),
        (lambda: tn.Linear("int8", 64, 64, 48), "group_size"),
        (lambda: tn.Linear("int8", 64, 64, 32, list(range(16))), "levels"),
        (lambda: tn.Linear("int4", 64, 64, 32, [0] * 16), "levels"),
        (lambda: lin.forward(x.astype(np.float64), np.zeros((2, 64), np.float32), pool), "x"),
        (lambda: lin.forward(np.zeros((2, 63), np.float32), np.zeros((2, 64), np.float32), pool), "x"),
        (lambda: lin.forward(x, np.zeros((3, 64), np.float32), pool), "out"),
        (lambda: lin.forward(x, x, pool), "out"),
        (lambda: lin.forward(x, np.zeros((2, 64), np.float32), pool, "sse9"), "isa|unknown"),
        (lambda: lin.pack(np.zeros((65, 64), np.float32), pool), "row0"),
        (lambda: lin.pack(np.full((64, 64), np.inf, np.float32), pool), "non-finite"),
        (lambda: lin.put_codes(0, np.full((2, 64), 16, np.uint8), np.ones((2, 2), np.uint16)), "codes"),
        (lambda: lin.put_codes(0, np.zeros((2, 64), np.uint8), np.ones((2, 3), np.uint16)), "scales"),
        (lambda: lin.put_codes(63, np.zeros((2, 64), np.uint8), np.ones((2, 2), np.uint16)), "row0"),
        (lambda: lin.put_codes(0, np.zeros((2, 64), np.uint8), np.ones((2, 2), np.uint16), np.ones((2, 2), np.uint16)), "mins"),
        (lambda: packed("bf16", np.zeros((64, 64), np.float32), pool).put_codes(0, np.zeros((1, 64), np.uint8), np.ones((1, 2), np.uint16)), "bf16"),
        (lambda: lin.set_bias(np.zeros(63, np.float32)), "bias"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
