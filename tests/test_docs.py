"""docs/operators.md must match the rule registry."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_operators_doc", ROOT / "tools" / "gen_operators_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_operators_doc_is_current():
    gen = _load_generator()
    assert (ROOT / "docs" / "operators.md").read_text() == gen.render(), (
        "docs/operators.md is stale: run `python tools/gen_operators_doc.py`"
    )


def test_every_rule_has_a_docstring_with_its_math():
    import scalify

    missing = [p.name for p, info in scalify.registered_rules().items()
               if info.fn.__module__.startswith("scalify.") and not (info.fn.__doc__ or "").strip()]
    assert not missing, f"rules without a docstring: {missing}"
