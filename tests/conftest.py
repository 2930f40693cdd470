"""Shared pytest set-up.

``tests/distributed`` needs several processes, so plain ``pytest`` (no
``torchrun``) leaves it out; ``torchrun --nproc-per-node 4 -m pytest
tests/distributed`` runs it.
"""

import os

collect_ignore = [] if "WORLD_SIZE" in os.environ else ["distributed"]
