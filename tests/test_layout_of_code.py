"""The package's shape: layers that import one way, no import cycle, no oversized file."""

from __future__ import annotations

import ast
from pathlib import Path

import morphkv

ROOT = Path(morphkv.__file__).parent
# each layer may import only these layers (and itself); the facade (morphkv/__init__) any
BELOW_RUNTIME = {"runtime", "mlxlm", "model", "core"}
ALLOWED = {
    "cli": {"cli", "bench", "eval", "server", "chat"} | BELOW_RUNTIME,  # cli above all
    "bench": {"bench", "eval", "server", "chat"} | BELOW_RUNTIME,  # speed/load use eval's parts
    "eval": {"eval"} | BELOW_RUNTIME,
    "server": {"server"} | BELOW_RUNTIME,
    "chat": {"chat"} | BELOW_RUNTIME,
    "runtime": BELOW_RUNTIME,
    "mlxlm": {"mlxlm", "core"},
    "model": {"model"},
    "core": {"core"},
}
LAYERS = list(ALLOWED)
# no folder holds more than this share of the package's lines (0.30 until issue 44 removed
# 2,700 lines of eval/ and bench/: core/ did not grow much, its share did; a split of core/ into
# cache and engine is the way back under 0.30)
MAX_FOLDER_SHARE = 0.33


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ["morphkv", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """morphkv modules that ``name`` imports anywhere (lazy imports included)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in mods else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in mods and m != name}


def _graph():
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def test_layers_import_one_way():
    wrong = []
    for name, deps in _graph().items():
        layer = _layer(name)
        if layer is None:
            continue  # the package facade (morphkv/__init__, __main__) may import any layer
        for dep in deps:
            other = _layer(dep) or dep
            if other not in ALLOWED[layer]:
                wrong.append(f"{name} -> {dep}")
    assert not wrong, "imports against the layering: " + ", ".join(sorted(wrong))


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_file_over_400_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"files over 400 lines: {long}"


def test_no_folder_over_a_share_of_the_lines():
    lines = {p: len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    total = sum(lines.values())
    share = {}
    for p, n in lines.items():
        folder = p.relative_to(ROOT).parts[0] if len(p.relative_to(ROOT).parts) > 1 else "."
        share[folder] = share.get(folder, 0) + n / total
    big = {f: round(s, 3) for f, s in share.items() if s > MAX_FOLDER_SHARE}
    assert not big, f"folders over {MAX_FOLDER_SHARE:.0%} of the package's lines: {big}"
