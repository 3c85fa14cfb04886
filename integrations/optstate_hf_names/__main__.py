"""``python -m optstate_hf_names install|uninstall|status``: put ``optstate_hf_names.pth`` into (or
take it out of) this interpreter's site-packages.

A wheel install (``pip install optstate[hf]``) carries the file already. An editable install
(``pip install -e .``) does not: run ``python -m optstate_hf_names install`` once after it
(quickstart.py does). ``--dir`` picks another site directory.
"""
from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

from . import ENV, PTH_NAME, enabled, is_hooked

SOURCE = Path(__file__).resolve().with_name(PTH_NAME)


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def install(directory: Path) -> bool:
    """Write the ``.pth`` into ``directory``; False when it is there already with the same line."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / PTH_NAME
    text = SOURCE.read_text()
    if target.exists() and target.read_text() == text:
        return False
    target.write_text(text)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m optstate_hf_names", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("install", "uninstall", "status"))
    parser.add_argument("--dir", type=Path, default=None, help="site directory (default: this interpreter's "
                        "site-packages)")
    args = parser.parse_args(argv)
    directory = args.dir or site_packages()
    target = directory / PTH_NAME
    if args.action == "install":
        print(f"{'installed' if install(directory) else 'up to date'}: {target}")
    elif args.action == "uninstall":
        if target.exists():
            target.unlink()
        print(f"removed: {target}")
    else:
        print(f"{target}: {'present' if target.exists() else 'absent'}; hook in this process: "
              f"{'on' if is_hooked() else 'off'}{'' if enabled() else f' ({ENV} turns it off)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
