"""The self-contained Python snippets of README.md and docs/ run as written.

A snippet is self-contained when it imports what it uses; fragments that continue a user's
own code (`params`, `grads`, ...) are not run here.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = {
    # (file, a line that identifies the snippet)
    "readme-adding-a-rule": ("README.md", 'double_p = Primitive("double")'),
    "concepts-adding-a-rule": ("docs/concepts.md", 'larger_p = Primitive("larger")'),
    "fp8-dense-roles": ("docs/fp8.md", "fp8 = functools.partial(Dense"),
    "frameworks-nnx": ("docs/frameworks.md", "step = nnx.jit(scalify.scalify(train_step))"),
    "frameworks-equinox": ("docs/frameworks.md", "step = eqx.filter_jit(scalify.scalify(train_step))"),
}


def _snippet(path, marker):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(), re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{path}: expected one snippet containing {marker!r}"
    return found[0]


@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_snippet_runs(name, monkeypatch):
    path, marker = SNIPPETS[name]
    monkeypatch.syspath_prepend(str(ROOT))
    code = compile(_snippet(path, marker), f"{path} ({name})", "exec")
    exec(code, {"__name__": f"snippet_{name}"})
