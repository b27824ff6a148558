"""experiments/nanogpt/xla_flags.py: the example turns XLA's excess precision off before JAX starts."""
import os
import subprocess
import sys
from pathlib import Path

from experiments.nanogpt import xla_flags

ROOT = Path(__file__).resolve().parents[2]


def test_configure_sets_the_flag_before_jax_starts_and_xla_accepts_it():
    code = ("from experiments.nanogpt import xla_flags as X; print(X.configure()); "
            "import jax, jax.numpy as jnp; print(float(jnp.ones(3, jnp.float16).sum()))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["--xla_allow_excess_precision=false", "3.0"]


def test_configure_keeps_the_users_choice(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=true")
    assert xla_flags.configure() == "--xla_allow_excess_precision=true"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert xla_flags.configure(excess_precision=True) == "--xla_cpu_enable_fast_math=false"


def test_configure_after_jax_started_changes_nothing_and_says_so(monkeypatch, capsys):
    import jax

    jax.devices()  # the backend is up: XLA would ignore a new flag
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert xla_flags.configure() == "--xla_cpu_enable_fast_math=false"
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"
    assert "not applied" in capsys.readouterr().err
