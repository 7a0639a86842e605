"""The launcher's per-machine defaults: printed at start, taken unless a flag says otherwise."""

import pytest

from services.launcher.__main__ import DEFAULT_MODEL_DENSE_FORMAT, DEFAULT_MODEL_FORMAT, machine_defaults, parse
from tests.checkpoints import checkpoint


def test_the_machine_defaults_are_printed_and_taken(capsys):
    d = machine_defaults()
    cfg = parse(["serve", "--model", str(checkpoint("qwen3_moe"))])
    line = f"defaults on this machine: --dtype {d.dtype} --dense-format {d.dense_format} --format {d.format}"
    assert line in capsys.readouterr().out
    assert (cfg.dtype, cfg.dense_format, cfg.format) == (d.dtype, d.dense_format, d.format)


def test_flags_override_the_defaults_and_the_built_in_model_keeps_its_own():
    cfg = parse(["serve", "--model", str(checkpoint("qwen3_moe")), "--dense-format", "bf16", "--format", "int8",
                 "--dtype", "bfloat16"])
    assert (cfg.dtype, cfg.dense_format, cfg.format) == ("bfloat16", "bf16", "int8")
    builtin = parse(["serve"])
    assert (builtin.dense_format, builtin.format) == (DEFAULT_MODEL_DENSE_FORMAT, DEFAULT_MODEL_FORMAT)


def test_a_cpu_without_a_gpu_packs_its_dense_linears():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine keeps float dense weights on the GPU")
    assert machine_defaults().dense_format != "float"


def test_an_unknown_dense_format_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["serve", "--dense-format", "int3"])
    assert "--dense-format" in capsys.readouterr().err


def test_the_cpu_wake_hold_is_on_by_default_says_whether_it_can_act_here_and_can_be_turned_off(capsys):
    from services.common import cpu_wake

    assert parse(["serve", "--model", str(checkpoint("qwen3_moe"))]).keep_cpus_awake
    out = capsys.readouterr().out
    assert ("holds idle CPUs polling" in out) == cpu_wake.available()
    assert not parse(["serve", "--model", str(checkpoint("qwen3_moe")), "--no-keep-cpus-awake"]).keep_cpus_awake
