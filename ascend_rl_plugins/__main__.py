import os
import sys

os.environ["_ASCEND_RL_CLI"] = "1"
from ascend_rl_plugins.cli import main  # noqa: E402

sys.exit(main())
