"""Collection set-up for the whole repo (``pytest`` also collects the package's doctests).

Without torchtitan (an optional extra, Python >= 3.11) or transformers (another) the modules that import them
at the top are left out of collection; their tests skip with the reason (``tests/torchtitan_models.py``,
``tests/test_transformers.py``).
"""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("torchtitan") is None:
    collect_ignore += ["spmdmoe/integrations/torchtitan.py", "spmdmoe/integrations/torchtitan_modules.py",
                       "tests/torchtitan_parallelize.py"]
if importlib.util.find_spec("transformers") is None:
    collect_ignore += ["spmdmoe/integrations/transformers.py", "spmdmoe/integrations/transformers_modules.py",
                       "spmdmoe/integrations/transformers_sp.py"]
