"""Packaging: the wheel holds the `scalify` package only (the NanoGPT example, the tests and
the benchmarks run from the checkout), and `import scalify` from a directory that holds a
folder named `scalify` without ``__init__.py`` (e.g. the parent of a clone named
`scalify`) gets the real package, not that folder as a namespace package."""
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIST = "scalify-jax"


def _discovered_packages() -> tuple[list[str], dict]:
    """The packages and package_dir that setuptools puts in the wheel, from pyproject.toml
    (its package discovery, as in a build, without building)."""
    code = ("import json, warnings; warnings.simplefilter('ignore')\n"
            "from setuptools.dist import Distribution\n"
            "from setuptools.config.pyprojecttoml import apply_configuration\n"
            "d = apply_configuration(Distribution(), 'pyproject.toml')\n"
            "print(json.dumps([d.packages, d.package_dir]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    packages, package_dir = json.loads(proc.stdout.splitlines()[-1])
    return packages, package_dir


def test_wheel_holds_scalify_only():
    packages, _ = _discovered_packages()
    assert {p.split(".")[0] for p in packages} == {"scalify"}, (
        f"top-level packages of the wheel: {sorted({p.split('.')[0] for p in packages})}; only "
        "`scalify` belongs there ([tool.setuptools.packages.find] in pyproject.toml)")
    # Every folder of the package with an __init__.py is in the wheel.
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "scalify").rglob("__init__.py")
               if "__pycache__" not in p.parts}
    assert on_disk - set(packages) == set(), f"subpackages missing from the wheel: {on_disk - set(packages)}"


def _editable_install_of_this_checkout() -> bool:
    """Whether an installed `scalify-jax` is an editable install of this checkout (the
    checkout's own build metadata, ``scalify_jax.egg-info``, has no direct_url.json)."""
    for dist in metadata.distributions(name=DIST):
        info = json.loads(dist.read_text("direct_url.json") or "{}")
        if info.get("dir_info", {}).get("editable") and info.get("url") == ROOT.as_uri():
            return True
    return False


def test_import_from_the_parent_of_a_folder_named_scalify(tmp_path):
    """With an editable install of this checkout, the install alone (no PYTHONPATH) must
    resolve `scalify`; otherwise the environment the tests run in does."""
    (tmp_path / "scalify").mkdir()  # a folder without __init__.py, as a clone's top folder
    env = dict(os.environ)
    if _editable_install_of_this_checkout():
        env.pop("PYTHONPATH", None)
    code = "import scalify; print(scalify.__file__); scalify.as_scaled_array"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (
        f"`import scalify` next to an empty `scalify/` folder failed:\n{proc.stderr[-2000:]}\nAn editable "
        "install made before pyproject.toml's package-dir setting uses setuptools' import hook, which a "
        "namespace folder shadows: reinstall it (python -m pip install -e .).")
    init = Path(proc.stdout.split()[0])
    assert init.name == "__init__.py" and init.parent.name == "scalify" and tmp_path not in init.parents
