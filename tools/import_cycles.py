"""Check optstate_core's layering: no import cycle among its modules (every import counts:
top-level, in functions, under TYPE_CHECKING), the core never imports the apps, and each room
(a subpackage, or a top-level module named in ROOM_RULES) imports only the rooms its rule
allows: a subpackage states them in its ``__init__`` docstring ("May import: state, policy.").
Exit status 1 on any break. Usage: python tools/import_cycles.py"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "optstate_core"
#: rooms that are single top-level modules, and what they may import (subpackages say it themselves)
ROOM_RULES = {"policy": {"state"}, "metrics": {"state"}, "preset_table": {"state", "policy"},
              "tuning": {"state", "step", "schedule"}}


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


def room_of(module: str):
    """The room of a core module: its subpackage or top-level module (None for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def allowed_rooms(files) -> dict:
    """Each room's allowed imports: ROOM_RULES, and the "May import:" line of each subpackage's
    ``__init__`` docstring ("nothing else of optstate_core" allows none)."""
    rules = {room: set(allowed) for room, allowed in ROOM_RULES.items()}
    for name, path in files.items():
        if name.count(".") == 1 and path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            line = next((ln for ln in doc.splitlines() if ln.startswith("May import:")), None)
            if line is None:
                continue
            text = line.removeprefix("May import:").strip().rstrip(".")
            rules[name.split(".")[1]] = set() if text.startswith("nothing") else {r.strip() for r in text.split(",")}
    return rules


def room_breaks(graph, rules) -> list:
    """Imports from one room into another that its rule does not allow."""
    found = []
    for m, deps in graph.items():
        src = room_of(m)
        if src not in rules:
            continue
        for d in deps:
            dst = room_of(d)
            if dst is not None and dst != src and dst not in rules[src]:
                found.append(f"{m} -> {d} ({src} may import: {', '.join(sorted(rules[src])) or 'nothing'})")
    return sorted(found)


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
    breaks = room_breaks(graph, allowed_rooms(files))
    for c in cycles:
        print("cycle: " + " -> ".join(c))
    for edge in breaks:
        print("room rule broken: " + edge)
    for edge in core_to_apps:
        print("core imports an app: " + edge)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, {len(cycles)} cycles, "
          f"{len(core_to_apps)} core->apps imports, {len(breaks)} room rules broken")
    return 1 if cycles or core_to_apps or breaks else 0


if __name__ == "__main__":
    sys.exit(main())
