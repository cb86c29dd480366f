"""The house rules: three floors at the repository root, installed as onepass.{kernels,engine,harness}; a floor
imports only the floors below it; our kernels/ folder never hides Hugging Face's `kernels` package; a wheel
carries every floor and the files they read (conf/, the CUDA sources)."""
import ast
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("kernels", "engine", "harness")   # ground floor first: each may import only the floors before it


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every onepass module a file imports, at any depth (function-level imports included), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("onepass.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("onepass."):
                out.append((node.lineno, node.module))
            elif node.module == "onepass":
                out += [(node.lineno, f"onepass.{a.name}") for a in node.names]
    return out


def floor_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for i, floor in enumerate(FLOORS):
        allowed = FLOORS[:i + 1]
        for path in sorted((root / floor).rglob("*.py")):
            for line, mod in _imports(path):
                target = mod.split(".")[1]
                if target in FLOORS and target not in allowed:
                    bad.append(f"{path.relative_to(root)}:{line} imports {mod} (a {floor} module may import "
                               f"only {', '.join(allowed)})")
    return bad


def test_floors_import_only_downwards():
    assert floor_violations() == []


def test_floor_scan_catches_an_upward_import(tmp_path):
    """The scan is not vacuous: a kernel that imports the engine, even inside a function, is reported."""
    for floor in FLOORS:
        (tmp_path / floor).mkdir()
    (tmp_path / "kernels" / "k.py").write_text("def f():\n    from onepass.engine.config import ModelConfig\n")
    (tmp_path / "engine" / "e.py").write_text("import onepass.harness.report\nfrom onepass.kernels import pdl\n")
    (tmp_path / "harness" / "h.py").write_text("from onepass import engine, kernels\n")
    bad = floor_violations(tmp_path)
    assert len(bad) == 2 and bad[0].startswith("kernels/k.py:2") and bad[1].startswith("engine/e.py:1")


def test_kernels_is_not_a_regular_package_at_the_root():
    """A regular package named kernels/ at the root would win over Hugging Face's `kernels` (which transformers
    imports) whenever the root is on sys.path; without __init__.py our folder never does."""
    assert not (ROOT / "kernels" / "__init__.py").exists()


def _python(code: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    """`python -c code` run in cwd: the current directory is then first on sys.path, as for `python -m ...`."""
    e = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env={**e, **env},
                          capture_output=True, text=True, timeout=300)


def test_hugging_face_kernels_is_not_shadowed(tmp_path):
    """From the repository root, `import kernels` finds an installed `kernels` package (Hugging Face's where it is
    installed, else a stand-in placed last on sys.path), never our folder, and transformers builds a model."""
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    r = _python(f"""
        import pathlib, sys
        sys.path.append({str(tmp_path / "site")!r})
        import kernels
        assert getattr(kernels, "__file__", None), ("a namespace package", list(kernels.__path__))
        assert not pathlib.Path(kernels.__file__).resolve().is_relative_to({str(ROOT / "kernels")!r}), kernels.__file__
        import onepass.kernels.pdl
        import transformers
        transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                               num_hidden_layers=1, num_attention_heads=2,
                                                               num_key_value_heads=1))
        """, ROOT)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_wheel_installs_every_floor(tmp_path):
    """A wheel built from the checkout holds the three floors, conf/ and the CUDA sources, and imports from a
    folder that has no checkout in it."""
    src = tmp_path / "src"       # built from a copy: setuptools writes build/ beside the sources
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", ".gpu", ".whl", "build", "outputs",
                                                             "multirun", "mlruns", "__pycache__", "*.egg-info"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheel = next(tmp_path.glob("onepass-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for must in ("onepass/kernels/gemm.py", "onepass/engine/engine.py", "onepass/harness/app.py",
                 "onepass/conf/config.yaml", "onepass/conf/model/smollm2-135m.yaml"):
        assert must in names, must
    assert any(n.startswith("onepass/kernels/cuda/") and n.endswith(".cu") for n in names)
    assert not any(n.startswith(("kernels/", "engine/", "harness/", "tests/")) for n in names)
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    away = tmp_path / "elsewhere"
    away.mkdir()
    # -S: no .pth files, so the checkout's editable install cannot answer for onepass; the dependencies' folders
    # are put on the path by hand
    deps = [p for p in sys.path if p and Path(p).resolve() != ROOT]
    code = f"""
        import sys
        sys.path[:] = [{str(site)!r}] + {deps!r}
        import onepass.harness.app as app, onepass.kernels.gemm
        from onepass.engine import Engine
        assert app.__file__.startswith({str(site)!r}), app.__file__
        assert (app.CONF_DIR / "config.yaml").is_file(), app.CONF_DIR
        print("ok")
        """
    r = subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(code)], cwd=away, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
