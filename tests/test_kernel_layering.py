"""``diffusers_trtllm/kernels`` is the ground floor: its modules import nothing from the rest of the package."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "diffusers_trtllm"
KERNELS = PACKAGE / "kernels"


def _package_imports(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> list[str]:
    """The modules of ``package`` that ``path`` imports, relative imports resolved against ``path``'s package."""
    here = list(path.relative_to(package.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = ".".join((here[:len(here) - node.level + 1] if node.level else []) + [node.module or ""])
            found += [module.strip(".")] if node.module else [f"{module}{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [name for name in found if name.split(".")[0] == package.name]


def test_kernels_import_nothing_from_the_rest_of_the_package():
    offenders = {str(p.relative_to(KERNELS)): [name for name in _package_imports(p)
                                               if not name.startswith(f"{PACKAGE.name}.kernels.")]
                 for p in KERNELS.rglob("*.py")}
    assert {name: imports for name, imports in offenders.items() if imports} == {}


def test_relative_imports_are_resolved_from_nested_packages(tmp_path):
    package = tmp_path / PACKAGE.name
    nested = package / "kernels" / "sub"
    nested.mkdir(parents=True)
    (nested / "mod.py").write_text("from ...quant import P_SCALE\nfrom .. import numerics\nfrom . import sibling\n"
                                   "import torch\n")
    assert _package_imports(nested / "mod.py", package) == [
        f"{PACKAGE.name}.quant", f"{PACKAGE.name}.kernels.numerics", f"{PACKAGE.name}.kernels.sub.sibling"]


def test_the_attention_op_and_the_planner_reach_backends_and_kernels_only_through_their_package_api():
    """The per-call op runs whatever route planning resolved: it imports the backends' package, no single backend;
    the planner takes kernel facts from the backends, not a Triton kernel's constants."""
    op = [name for name in _package_imports(PACKAGE / "ops.py") if name.startswith(f"{PACKAGE.name}.backends.")]
    assert op == [f"{PACKAGE.name}.backends.base"]  # the contract types (VarlenQKV, KernelPlan), no backend
    plan = _package_imports(PACKAGE / "plan.py")
    assert not [name for name in plan if name.startswith(f"{PACKAGE.name}.kernels")], plan
