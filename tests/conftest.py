"""Suite-wide settings.

The CPU backend gets 8 host devices (XLA_FLAGS), so the multi-device tests run in the
suite's own processes.

Model-invariance tests compare scalified and plain float32 results to ~1e-6: matmuls must
run in full float32 precision. GPUs default to TF32 for float32 matmuls (10-bit mantissa),
which makes any two differently-shaped or differently-fused computations disagree at
~1e-3; "highest" is a no-op on CPU.
"""
import importlib.metadata
import os

# Eight CPU devices for the multi-device tests (tests/distributed), set before JAX creates
# its CPU backend; single-device computations are unchanged (they run on device 0).
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

# XLA:CPU compiles faster (the suite's time is mostly compilation): XLA's classic fusion
# emitters rather than the MLIR ones, no LLVM optimisation (-O0) rather than -O2/-O3, each
# program's code in one LLVM module. The NanoGPT `tiny` fp8 step compiles in 6.5 s rather
# than 25 s (12 s at -O1), the plain step in 1.5 s rather than 6 s; the code runs slower
# (300 steps of the fp16 stock transformer: 14 s rather than 7 s at -O1), which the few
# tests that train for hundreds of steps pay, and the whole suite is about 20% faster than
# at -O1. Values: float32 results differ from -O1's by a few ulps where LLVM would have
# contracted or reordered arithmetic (tests/ops/test_activations.py's gelu_tanh gradient,
# whose tolerance states why). The emitters also
# decide some fusions (the compiled HLO of that step: 742 fusions rather than 785); the
# collectives, and every count and bound the tests check, are the same. One difference in
# values: the classic emitters cast a negative value that rounds to zero to the fnuz
# formats' NaN (tests/quant/test_quant_formats.py compiles that cast with the default
# emitters). A flag the user set (the same name in XLA_FLAGS) is kept; with
# SCALIFY_TESTS_XLA_DEFAULTS=1 the suite runs with XLA's defaults.
# The flags are XLA internals, checked with jaxlib 0.10; XLA aborts on a flag it does not
# know, so other jaxlib versions keep XLA's defaults.
_COMPILE_FLAGS = {"xla_cpu_use_fusion_emitters": "false", "xla_backend_optimization_level": "0",
                  "xla_cpu_parallel_codegen_split_count": "1"}
_JAXLIB = importlib.metadata.version("jaxlib")
# For the jitted training loops of hundreds of steps (fixture `long_run_compiler_options`):
# their code at LLVM -O1, per program (`jax.jit(compiler_options=...)`), where the suite
# compiles at -O0.
_LONG_RUN_OPTIONS = {}
if os.environ.get("SCALIFY_TESTS_XLA_DEFAULTS", "0") in ("", "0") and _JAXLIB.startswith("0.10."):
    for _name, _value in _COMPILE_FLAGS.items():
        if f"--{_name}=" not in os.environ["XLA_FLAGS"]:
            os.environ["XLA_FLAGS"] += f" --{_name}={_value}"
            if _name == "xla_backend_optimization_level":
                _LONG_RUN_OPTIONS = {_name: 1}

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Compiled programs are cached for the test session (JAX's persistent compilation cache, in
# a temporary directory removed at exit). Tests build their functions afresh (a new
# closure, a new `jax.jit`), so JAX's in-memory caches miss where two tests, or two calls
# of a helper, compile the same program (the NanoGPT parameter init of
# `experiments.nanogpt.step.init_state`, a plain reference step, a shared evaluation
# function, the primitives of op-by-op dispatch); the persistent cache keys on the lowered
# program itself (with the compile options, the XLA flags and the backend), so such a
# program is compiled once and its executable reused. Nothing else changes: a hit is the
# executable the miss compiled. The pytest process makes the directory and its pytest-xdist
# workers, started after this file is read, inherit it (SCALIFY_TESTS_XLA_CACHE): a program
# one worker compiled is a hit in the other. A cache directory set by the user
# (JAX_COMPILATION_CACHE_DIR) is left as is.
_CACHE_ENV = "SCALIFY_TESTS_XLA_CACHE"
if not jax.config.jax_compilation_cache_dir:
    _cache_dir = os.environ.get(_CACHE_ENV)
    if not _cache_dir or not os.path.isdir(_cache_dir):
        _cache_dir = tempfile.mkdtemp(prefix="scalify-tests-xla-cache-")
        os.environ[_CACHE_ENV] = _cache_dir
        atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    # Every program: a small one (an entry of a few KB, written in about a millisecond)
    # costs tens of milliseconds to compile, and tests that wrap the same function in a
    # new `jax.jit` per parametrization compile it again and again.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # The key leaves out the program's metadata (source locations, op names), as JAX does by
    # default: a program that differs from a cached one only there gets the cached
    # executable, whose compiled HLO carries the other program's metadata. Tests that read
    # it use the fixture `metadata_in_cache_key`.


import pytest  # noqa: E402

import scalify  # noqa: E402


@pytest.fixture
def arguments_as_given():
    """For tests that place data at a chosen scale to check a rule's scale arithmetic: the
    input guard (`ScalifyConfig.input_drift_window`) would first move drifted arguments to
    unit data (same values, other scales)."""
    with scalify.ScalifyConfig(input_drift_window=None):
        yield


@pytest.fixture
def long_run_compiler_options():
    """XLA options for a test's jitted steps that run hundreds of times: LLVM -O1 where this
    file set -O0 for the suite (the code then runs 2-10x faster for a slower compile), else
    none."""
    return dict(_LONG_RUN_OPTIONS)


@pytest.fixture
def metadata_in_cache_key():
    """For tests that read a compiled program's metadata (op names, source locations): the
    compilation cache key includes it, so that an executable compiled for a program that
    differs only in its metadata is not reused."""
    key = "jax_compilation_cache_include_metadata_in_key"
    before = getattr(jax.config, key)
    jax.config.update(key, True)
    yield
    jax.config.update(key, before)


# The suite's long tests (whole training steps and loops, compiled on CPU: tests/e2e,
# tests/distributed and the documentation snippets) run first. pytest-xdist's workers then
# spend the end of the run on short tests they can share (`--dist worksteal` moves pending
# tests, never a running one), instead of one worker finishing a long test alone.
_LONG_FIRST = ("e2e", "distributed", "test_doc_snippets.py")


def pytest_collection_modifyitems(session, config, items):
    def long_test(item):
        parts = item.path.relative_to(config.rootpath).parts
        return len(parts) > 1 and parts[0] == "tests" and parts[1] in _LONG_FIRST

    items.sort(key=lambda item: not long_test(item))  # stable: the order is kept otherwise
