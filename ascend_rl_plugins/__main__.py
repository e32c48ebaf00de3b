"""``python -m ascend_rl_plugins ...``: the ``ascend-rl`` command (never applies patches)."""

import sys

from ascend_rl_plugins.cli import main

sys.exit(main())
