"""The package's import structure: no circles, and no project import tucked inside a function.

Imports are read from the source (ast), module-level and function-level alike, so a circle hidden
behind an import inside a function is still a circle here. Nothing is imported or run.
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("eagle2_jax", "train", "infer")
# project imports allowed inside a function: the backends plug themselves in from outside the core
# (their registration is the one thing that may stay lazy)
LAZY_ALLOWED = set()


def _modules():
    """{dotted name: path} of every module under PACKAGES."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join(rel)] = os.path.join(dirpath, f)
    return out


MODULES = _modules()


def _resolve(module: str, is_package: bool, node) -> list:
    """The project modules one import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in PACKAGES]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    if prefix.split(".")[0] not in PACKAGES:
        return []
    names = [f"{prefix}.{a.name}" for a in node.names]
    subs = [n for n in names if n in MODULES]  # `from pkg import submodule`
    return subs + ([prefix] if len(subs) < len(names) else [])


def imports(module: str):
    """[(imported project module, inside a function?)] of one module."""
    path = MODULES[module]
    tree = ast.parse(open(path).read(), path)
    is_package = path.endswith("__init__.py")
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((m, in_function) for m in _resolve(module, is_package, child))
            visit(child, inner)
    visit(tree, False)
    return found


def graph():
    return {m: sorted({t for t, _ in imports(m) if t in MODULES and t != m}) for m in MODULES}


def find_circle(g):
    """One import circle as a list of modules, or None (depth-first search, package faces skipped:
    a package's __init__ importing its own submodules is how it shows its API, not a dependency)."""
    faces = {m for m in g if MODULES.get(m, "").endswith("__init__.py")}
    state, stack = {}, []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for t in g[m]:
            if t in faces and m.startswith(t + "."):
                continue  # a submodule importing its own package's face
            if m in faces and t.startswith(m + "."):
                continue
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if state.get(t) is None:
                c = dfs(t)
                if c:
                    return c
        stack.pop()
        state[m] = 2
        return None
    for m in sorted(g):
        if state.get(m) is None:
            c = dfs(m)
            if c:
                return c
    return None


def test_the_finder_sees_a_circle_and_a_lazy_import(tmp_path):
    """The check itself: a made-up circle is found, a chain is not."""
    assert find_circle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_circle({"a": ["b"], "b": ["c"], "c": []}) is None
    src = "import os\n\ndef f():\n    from .models import ops\n    return ops\n"
    MODULES["eagle2_jax._probe"] = str(tmp_path / "_probe.py")
    (tmp_path / "_probe.py").write_text(src)
    try:
        assert imports("eagle2_jax._probe") == [("eagle2_jax.models.ops", True)]
    finally:
        del MODULES["eagle2_jax._probe"]


def test_no_import_circles():
    circle = find_circle(graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_project_imports_inside_functions(package):
    lazy = sorted(f"{m} imports {t}" for m in MODULES if m.split(".")[0] == package
                  for t, inside in imports(m) if inside and (m, t) not in LAZY_ALLOWED)
    assert not lazy, "imports inside functions: " + "; ".join(lazy)


# The package's parts, bottom to top: a module may import its own part and the parts below it only.
# The foundation (config, sharding, platform, file_cache) is the package's root; backends plug in from
# outside (only the package face imports them, to register them).
LAYERS = {"eagle2_jax": 0, "eagle2_jax.models": 1, "eagle2_jax.loading": 2, "eagle2_jax.decoding": 3,
          "eagle2_jax.backends": 4, "eagle2_jax.serving": 5}


def part(module: str) -> str:
    """The part a module belongs to: its subpackage under eagle2_jax, or the root."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (len(parts) == 2 and ".".join(parts) in LAYERS) else parts[0]


def test_the_parts_depend_one_way():
    wrong = []
    for m, targets in graph().items():
        if not m.startswith("eagle2_jax") or m == "eagle2_jax":
            continue
        for t in targets:
            if not t.startswith("eagle2_jax") or t == "eagle2_jax":
                continue
            a, b = part(m), part(t)
            if b == "eagle2_jax.backends" and a != b:
                wrong.append(f"{m} imports the backend {t}")
            elif a != b and LAYERS[b] > LAYERS[a]:
                wrong.append(f"{m} ({a}) imports {t} ({b}), a part above it")
    assert not wrong, "; ".join(wrong)
