"""The house rules that keep the architecture visible: no import cycle, the core never imports the apps,
no core file over ~450 lines."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_import_cycle_and_core_never_imports_apps(capsys):
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main() == 0, capsys.readouterr().out


def test_no_core_file_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "optstate_core").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long
