"""Collection set-up for the whole repo (``pytest`` also collects the package's doctests).

Without torchtitan (an optional extra, Python >= 3.11) the modules that import it at the top are left out
of collection; their tests skip with the reason (``tests/torchtitan_models.py``).
"""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("torchtitan") is None:
    collect_ignore += ["spmdmoe/integrations/torchtitan.py", "spmdmoe/integrations/torchtitan_modules.py",
                       "tests/torchtitan_parallelize.py"]
