"""``verl.plugins`` entry point (verl >= 0.9 imports it: ``entry_point.load()``).

verl only *loads* the entry point, so activation happens at import. verl catches any
``Exception`` of that import and logs it at debug level, running on without the plugin: a
bad flag therefore stops the process with ``SystemExit`` (which verl does not catch).
"""

from .plugin import activate_or_exit

activate_or_exit("verl.plugins")
