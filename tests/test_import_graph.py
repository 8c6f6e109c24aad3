"""The library's import graph has no circles, counting imports inside functions too (a deferred import that
closes a circle still means two modules depend on each other)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "diffusers_trtllm"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").is_file()


def imported_modules(path: Path) -> set[str]:
    """Package modules ``path`` imports, with the packages an import runs on the way (their ``__init__``)."""
    name = module_name(path)
    here = name if is_package(name) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parent = here.split(".")[:len(here.split(".")) - node.level + 1] if node.level else []
            base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names
                       if (PACKAGE.parent / f"{base}.{alias.name}".replace(".", "/")).with_suffix(".py").is_file()
                       or is_package(f"{base}.{alias.name}")] or [base]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            if not target.startswith("diffusers_trtllm"):
                continue
            parts = target.split(".")
            for i in range(2, len(parts) + 1):  # the root package is every module's ancestor: not an edge
                step = ".".join(parts[:i])
                if not name.startswith(step + ".") and step != name:
                    found.add(step)
    return found


def test_no_import_circles():
    graph = {module_name(p): imported_modules(p) for p in PACKAGE.rglob("*.py")}
    circles, done = [], set()

    def visit(node, stack):
        if node in stack:
            circles.append(stack[stack.index(node):] + [node])
            return
        if node in done:
            return
        for child in sorted(graph.get(node, ())):
            visit(child, stack + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)
