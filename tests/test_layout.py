"""The house rules that keep the architecture visible: no import cycle, the core never imports the apps,
no core file over ~450 lines."""
from pathlib import Path

import helpers

ROOT = Path(__file__).resolve().parents[1]


def test_no_import_cycle_and_core_never_imports_apps(capsys):
    tool = helpers.load_tool("import_cycles")
    assert tool.main() == 0, capsys.readouterr().out


def test_no_core_file_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "optstate_core").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_top_level_holds_the_public_face_and_rooms():
    """optstate_core/ holds the public face (and the two modules every room asks), the rest in
    subpackages whose ``__init__`` says what lives there and which rooms they may import."""
    top = {p.name for p in (ROOT / "optstate_core").glob("*.py")}
    assert top == {"__init__.py", "__main__.py", "optimizer.py", "options.py", "presets.py", "preset_table.py",
                   "torch_optstate_names.py", "policy.py", "metrics.py", "tuning.py"}, top
    rooms = {p.parent.name for p in (ROOT / "optstate_core").glob("*/__init__.py")}
    assert rooms == {"state", "step", "schedule", "apps"}, rooms
    for room in ("state", "step", "schedule"):
        doc = (ROOT / "optstate_core" / room / "__init__.py").read_text()
        assert "May import:" in doc, room


def test_no_core_function_over_80_lines():
    """Functions stay readable: none in the core over 80 lines, but the Triton kernels (jit-decorated)."""
    import ast

    long = []
    for p in (ROOT / "optstate_core").rglob("*.py"):
        if "apps" in p.parts:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                kernel = any("jit" in ast.unparse(d) for d in node.decorator_list)
                if not kernel:
                    long.append(f"{p.relative_to(ROOT)}:{node.name}")
    assert not long, long


def test_step_paths_are_given_seams_not_the_engine():
    """The step paths (``step/``) receive a StepContext and the typed seams they use, never the
    engine: no parameter, variable or attribute named ``engine`` there (prose in docstrings aside)."""
    import ast

    found = []
    for p in (ROOT / "optstate_core" / "step").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.arg) and node.arg == "engine" or \
                    isinstance(node, ast.Name) and node.id == "engine" or \
                    isinstance(node, ast.Attribute) and node.attr in ("engine", "_engine"):
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
