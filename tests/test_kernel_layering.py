"""``diffusers_trtllm/kernels`` is the ground floor: its modules import nothing from the rest of the package."""

import ast
import pathlib

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "diffusers_trtllm" / "kernels"


def _package_imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level >= 2 or (node.level == 0 and module.startswith("diffusers_trtllm")):
                found.append(f"{'.' * node.level}{module}")
            elif node.level == 1 and module == "" and any(a.name not in _kernel_modules() for a in node.names):
                found.append(", ".join(a.name for a in node.names))
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("diffusers_trtllm")]
    return found


def _kernel_modules() -> set[str]:
    return {p.stem for p in KERNELS.glob("*.py")}


def test_kernels_import_nothing_from_the_rest_of_the_package():
    offenders = {p.name: _package_imports(p) for p in KERNELS.glob("*.py")}
    assert {name: imports for name, imports in offenders.items() if imports} == {}
