"""``python -m amp_runtime``: see amp_runtime.cli."""
from .cli import main

raise SystemExit(main())
