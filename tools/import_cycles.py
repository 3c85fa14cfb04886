"""List import cycles among optstate_core's modules (every import counts: top-level, in functions,
under TYPE_CHECKING). Exit status 1 if there is one. Usage: python tools/import_cycles.py"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "optstate_core"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, known: set) -> set:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            while c and c not in known:
                c = c.rpartition(".")[0]
            if c and c != name:
                found.add(c)
    return found


def main() -> int:
    files = {module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    known = set(files)
    graph = {m: imports_of(p, m, known) for m, p in files.items() if not m.endswith("__main__")}
    # a package's __init__ importing its own submodules is not a cycle of the code's rooms
    graph = {m: {d for d in deps if not (m == d.rpartition(".")[0] and files[m].name == "__init__.py")}
             for m, deps in graph.items()}
    cycles, seen = [], set()

    def visit(node, stack, on_stack):
        for dep in sorted(graph.get(node, ())):
            if dep in on_stack:
                cycle = stack[stack.index(dep):] + [dep]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    cycles.append(cycle)
            elif dep not in done:
                on_stack.add(dep)
                visit(dep, stack + [dep], on_stack)
                on_stack.discard(dep)
        done.add(node)

    done: set = set()
    for m in sorted(graph):
        if m not in done:
            visit(m, [m], {m})
    core_to_apps = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                          if d.startswith(f"{PACKAGE}.apps") and not m.startswith(f"{PACKAGE}.apps"))
    for c in cycles:
        print("cycle: " + " -> ".join(c))
    for edge in core_to_apps:
        print("core imports an app: " + edge)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, {len(cycles)} cycles, "
          f"{len(core_to_apps)} core->apps imports")
    return 1 if cycles or core_to_apps else 0


if __name__ == "__main__":
    sys.exit(main())
