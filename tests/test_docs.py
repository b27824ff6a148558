"""docs/operators.md must match the rule registry."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_operators_doc", ROOT / "tools" / "gen_operators_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_operators_doc_is_current():
    import jax

    gen = _load_generator()
    made_with = gen.jax_version_of(ROOT / "docs" / "operators.md")
    if made_with != jax.__version__:
        # Primitives differ between JAX versions (e.g. one_minus_square from 0.11).
        pytest.skip(f"docs/operators.md lists the rules seen with jax {made_with}; this is "
                    f"jax {jax.__version__}")
    assert (ROOT / "docs" / "operators.md").read_text() == gen.render(), (
        "docs/operators.md is stale: run `python tools/gen_operators_doc.py`"
    )


def test_every_rule_has_a_docstring_with_its_math():
    import scalify

    missing = [p.name for p, info in scalify.registered_rules().items()
               if info.fn.__module__.startswith("scalify.") and not (info.fn.__doc__ or "").strip()]
    assert not missing, f"rules without a docstring: {missing}"
