"""``python -m optstate_core``: the command-line apps' entry point."""
from .apps.cli import main

raise SystemExit(main())
