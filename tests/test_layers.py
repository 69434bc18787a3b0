"""The package's layers (docs/DESIGN.md, README "Layout"): each imports only the layers before it,
the torch-free ones import without torch, and no function hides an import of an ogspo module."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import ogspo

PACKAGE = Path(ogspo.__file__).parent
# in import order: a module may import its own layer and the layers before it
LAYERS = ("engine", "artifacts", "drafter", "offline", "methods", "learn", "analysis", "stages", "api", "cli")
TORCH_FREE = ("artifacts", "offline")


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) == 1:
        return None  # the package itself
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def _ogspo_imports(tree: ast.AST, module: str):
    """(import node, imported ogspo module, at module level?) for every import of an ogspo module."""
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if module.endswith("__init__") else 0)]
                names = [".".join(base + ([node.module] if node.module else []))]
            elif node.module:
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name == "ogspo" or name.startswith("ogspo."):
                yield node, name, id(node) in top


def test_layers_import_only_the_layers_before_them():
    problems = []
    for module, path in sorted(_modules().items()):
        own = _layer(module)
        if own is None:
            continue
        for node, name, at_top in _ogspo_imports(ast.parse(path.read_text()), module):
            if not at_top:
                problems.append(f"{module}:{node.lineno} imports {name} inside a function")
                continue
            theirs = _layer(name)
            if theirs is None and name != "ogspo":
                problems.append(f"{module}:{node.lineno} imports {name}, which is in no layer")
            elif theirs is not None and theirs > own:
                problems.append(f"{module}:{node.lineno} ({LAYERS[own]}) imports {name} ({LAYERS[theirs]}, a later layer)")
    assert not problems, "\n".join(problems)


def test_torch_free_layers_import_without_torch():
    modules = sorted(m for m in _modules() if _layer(m) is not None and LAYERS[_layer(m)] in TORCH_FREE)
    assert modules
    script = (  # a None entry in sys.modules makes `import torch` raise ImportError (as where torch is absent)
        "import importlib, sys\n"
        "for name in ('torch', 'transformers', 'onnxruntime'):\n"
        "    sys.modules[name] = None\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "try:\n"
        "    import torch\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('torch imported although blocked')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_module_is_listed():
    """pkgutil sees the same modules as the walk above (no namespace surprises)."""
    seen = {m.name for m in pkgutil.walk_packages([str(PACKAGE)], prefix="ogspo.")}
    assert seen <= set(_modules())


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_over_700_lines():
    long = {m: _lines(p) for m, p in _modules().items() if _lines(p) > 700}
    assert not long, long


def test_stages_hold_workflow_code_only():
    """Library code lives in the layers below: stages/ is at most a fifth of the package, and the API imports
    no stage."""
    total = sum(_lines(p) for p in _modules().values())
    stages = sum(_lines(p) for m, p in _modules().items() if m.startswith("ogspo.stages"))
    assert stages <= 0.20 * total, f"stages/ holds {stages} of {total} lines"
    api = ast.parse((PACKAGE / "api.py").read_text())
    assert not [name for _, name, _ in _ogspo_imports(api, "ogspo.api") if name.startswith("ogspo.stages")]
