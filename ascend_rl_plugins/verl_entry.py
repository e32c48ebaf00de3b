"""``verl.plugins`` entry point (verl >= 0.9 imports it: ``entry_point.load()``).

verl only *loads* the entry point and swallows its exceptions at debug level, so the
activation happens at import and a bad flag is also logged at error level.
"""

from .plugin import activate

activate("verl.plugins")
