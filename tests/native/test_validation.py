"""Bad arguments at the binding edge raise ValueError naming the argument; nothing crashes."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.native.test_kernels import ALL_ISAS
from tests.reference.moe import random_layer

tn = pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

E, D, I, K, T = 8, 64, 32, 2, 3


@pytest.fixture(scope="module")
def pool():
    return tn.ThreadPool(2)


@pytest.fixture(scope="module")
def weights():
    return random_layer(np.random.default_rng(0), E, D, I)


@pytest.fixture(scope="module")
def buffer(weights, pool):
    return tn.pack_experts(*weights, "int8", 32, pool)


@pytest.fixture(scope="module")
def layer(buffer):
    return tn.MoeLayer(buffer)


def args(**override):
    a = dict(
        x=np.ones((T, D), np.float32), ids=np.zeros((T, K), np.int64) + np.arange(K),
        weights=np.ones((T, K), np.float32), out=np.zeros((T, D), np.float32),
    )
    a.update(override)
    return a


@pytest.mark.parametrize("override, message", [
    (dict(x=np.ones((T, D), np.float64)), "x: expected dtype float32"),
    (dict(x=np.ones((T, D + 32), np.float32)), r"x: shape \[3, 96\], dimension 1 should be 64"),
    (dict(x=np.ones((T, 2 * D), np.float32)[:, ::2]), "x: must be C-contiguous"),
    (dict(x=np.ones((D,), np.float32)), "x: expected 2 dims"),
    (dict(ids=np.zeros((T, K), np.int32)), "ids: expected dtype int64"),
    (dict(ids=np.full((T, K), E, np.int64)), r"ids: expert id 8 out of range \[0, 8\)"),
    (dict(ids=np.full((T, K), -1, np.int64)), "ids: expert id -1 out of range"),
    (dict(ids=np.zeros((T + 1, K), np.int64)), "ids: shape"),
    (dict(weights=np.ones((T, K + 1), np.float32)), "weights: shape"),
    (dict(weights=np.ones((T, K), np.float16)), "weights: expected dtype float32"),
    (dict(out=np.zeros((T, D), np.float64)), "out: expected dtype float32"),
    (dict(out=np.zeros((T + 1, D), np.float32)), "out: shape"),
])
def test_bad_call_arguments(layer, pool, override, message):
    with pytest.raises(ValueError, match=message):
        tn.moe_forward(layer, pool=pool, **args(**override))
    out = np.zeros((T, D), np.float32)
    tn.moe_forward(layer, pool=pool, **args(out=out))  # and the layer still works
    assert np.abs(out).sum() > 0


def test_out_must_not_alias_x(layer, pool):
    x = np.ones((T, D), np.float32)
    with pytest.raises(ValueError, match="out: must not alias x"):
        tn.moe_forward(layer, pool=pool, **args(x=x, out=x))


@pytest.mark.parametrize("kind, message", [
    ("w13_dtype", "w13: expected dtype float32"),
    ("w2_shape", r"w2: shape \[8, 64, 16\], dimension 2 should be 32"),
    ("fmt", "fmt: unknown format 'int3'"),
    ("group", "group_size: 48 must be a multiple of 32"),
    ("nan", "w13: non-finite value"),
    ("huge", "w2: non-finite value, or a scale beyond fp16's range"),
    ("int4_width", "sizes must be multiples of 64 for int4"),
])
def test_bad_pack_arguments(weights, pool, kind, message):
    w13, w2 = weights
    fmt, group = "int8", 32
    if kind == "w13_dtype":
        w13 = w13.astype(np.float64)
    elif kind == "w2_shape":
        w2 = w2[:, :, :16].copy()
    elif kind == "fmt":
        fmt = "int3"
    elif kind == "group":
        group = 48
    elif kind == "int4_width":
        fmt = "int4"  # I = 32: int4 packs 64 columns per block
    elif kind == "nan":
        w13 = w13.copy()
        w13[3, 5, 7] = np.nan
    else:
        w2 = w2.copy()
        w2[1, 2, 3] = 1e12
    with pytest.raises(ValueError, match=message):
        tn.pack_experts(w13, w2, fmt, group, pool)


def test_non_finite_scale_in_a_buffer(buffer):
    bad = buffer.copy()
    header, values = 128, 2 * I * D  # format.h: a 128-byte header; expert 0's w13 int8 values come first, then its fp16 scales
    bad[header + values : header + values + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    with pytest.raises(ValueError, match="buffer: non-finite scale in expert 0"):
        tn.MoeLayer(bad)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:200], "buffer: 200 bytes"),
    (lambda b: b[:10], "buffer: too small"),
    (lambda b: np.concatenate([np.frombuffer(b"XXXXXXXX", np.uint8), b[8:]]), "buffer: not a packed MoE layer"),
])
def test_truncated_or_foreign_buffers(buffer, damage, message):
    with pytest.raises(ValueError, match=message):
        tn.MoeLayer(damage(buffer))


def test_a_packed_buffer_maps_back_from_a_file_without_copying(buffer, layer, pool, tmp_path):
    import mmap

    path = tmp_path / "layer.bin"
    buffer.tofile(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        mapped = tn.MoeLayer(mm)
        a, b = np.zeros((T, D), np.float32), np.zeros((T, D), np.float32)
        tn.moe_forward(mapped, pool=pool, **args(out=a))
        tn.moe_forward(layer, pool=pool, **args(out=b))
        assert np.array_equal(a, b)
        del mapped


def test_thread_count_must_be_positive():
    with pytest.raises(ValueError, match="threads: must be >= 1"):
        tn.ThreadPool(0)


def _import_with_isa(isa: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TANDEM_NATIVE_ISA": isa}
    code = "import tandem_native as tn; print(tn.active_isa())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_environment_variable_forces_a_lower_variant():
    for isa in tn.supported_isas():
        result = _import_with_isa(isa)
        assert result.returncode == 0 and result.stdout.strip() == isa


LACKED = [isa for isa in ALL_ISAS if isa not in tn.supported_isas()]


@pytest.mark.parametrize("isa, message", [
    pytest.param(LACKED[-1] if LACKED else "", "is not supported by this CPU",
                 marks=pytest.mark.skipif(not LACKED, reason="this CPU runs every variant")),
    ("sse9", "unknown ISA variant 'sse9'"),
])
def test_forcing_a_variant_the_cpu_lacks_is_a_clear_error(isa, message):
    result = _import_with_isa(isa)
    assert result.returncode != 0
    assert message in result.stderr


@pytest.mark.parametrize("call, message", [
    (lambda: tn.new_layer("int4", 2, 64, 64, 32, list(range(16))[::-1]), "levels: must be strictly increasing"),
    (lambda: tn.new_layer("int4", 2, 64, 64, 32, [1, 2, 3]), "levels: expected 16 values"),
    (lambda: tn.new_layer("int8", 2, 64, 64, 32, list(range(16))), "levels: only the int4 format"),
    (lambda: tn.new_layer("int4", 0, 64, 64, 32), "experts: must be >= 1"),
    (lambda: tn.new_layer("int4", 2, 96, 64, 32), "multiples of 64 for int4"),
    (lambda: tn.new_layer("int8", 2, 64, 64, 48), "group_size: 48"),
])
def test_new_layer_rejects_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_filling_calls_reject_bad_arguments(pool):
    buf = tn.new_layer("int4", 2, 64, 64, 32)
    w13, w2 = np.zeros((1, 128, 64), np.float32), np.zeros((1, 64, 64), np.float32)
    codes, scales = np.zeros((4, 64), np.uint8), np.zeros((4, 2), np.uint16)
    cases = [
        (lambda: tn.pack_into(buf, 2, w13, w2, pool), "first_expert: experts \\[2, 3\\) out of range"),
        (lambda: tn.pack_into(buf, 0, w13[:, :64], w2, pool), "w13: shape"),
        (lambda: tn.pack_into(buf[:200], 0, w13, w2, pool), "buffer: 200 bytes"),
        (lambda: tn.pack_into(np.frombuffer(buf.tobytes(), np.uint8), 0, w13, w2, pool), "buffer: must be writable"),
        (lambda: tn.put_codes(buf, 0, "w3", 0, codes, scales), "matrix: 'w13' or 'w2'"),
        (lambda: tn.put_codes(buf, 5, "w13", 0, codes, scales), "expert: 5 out of range"),
        (lambda: tn.put_codes(buf, 0, "w2", 62, codes, scales), "row0: rows \\[62, 66\\) out of range"),
        (lambda: tn.put_codes(buf, 0, "w13", 0, codes + 16, scales), "4-bit codes must be in \\[0, 15\\]"),
        (lambda: tn.put_codes(buf, 0, "w13", 0, codes, scales, scales), "mins: int4_asym layers need them"),
        (lambda: tn.put_codes(tn.new_layer("int4_asym", 2, 64, 64), 0, "w13", 0, codes, scales), "mins: int4_asym"),
        (lambda: tn.put_codes(tn.new_layer("int4_asym", 2, 64, 64), 0, "w13", 0, codes, scales, np.zeros((4, 1), np.uint16)),
         "mins: shape"),
        (lambda: tn.put_codes(buf, 0, "w13", 0, codes, np.zeros((4, 1), np.uint16)), "scales: shape"),
        (lambda: tn.put_codes(tn.new_layer("bf16", 2, 64, 64), 0, "w13", 0, codes, scales), "a bf16 layer has no codes"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_a_layer_whose_levels_are_not_increasing_is_refused():
    buf = tn.new_layer("int4", 2, 64, 64, 32)
    buf[40:56] = 0  # the header's levels (format.h)
    with pytest.raises(ValueError, match="int4 levels are not strictly increasing"):
        tn.MoeLayer(buf)


def test_the_best_variant_is_checked_against_generic_and_gives_way_when_it_disagrees():
    """At import the best variant runs a small layer of every format against generic; forced to
    disagree (TANDEM_NATIVE_SELFCHECK_FAULT), it gives way to the next one down with a warning."""
    isas = tn.supported_isas()
    if len(isas) < 2:
        pytest.skip("only the generic variant runs here")
    assert tn.active_isa() == isas[-1]
    code = "import warnings, tandem_native as t; warnings.simplefilter('always'); print(t.active_isa())"
    env = {**os.environ, "TANDEM_NATIVE_SELFCHECK_FAULT": isas[-1]}
    env.pop("TANDEM_NATIVE_ISA", None)
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == isas[-2]
    assert f"the {isas[-1]} kernels disagree with generic" in run.stderr and f"using {isas[-2]} instead" in run.stderr
