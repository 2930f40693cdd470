"""An older spmdmoe beside this one (``benchmarks/base_copy.sh``: the package renamed ``spmdmoe_base``): the
same layer config in its config class, for the benchmarks that time a change against the code before it."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["config_in"]


def config_in(moe_lib: Any, cfg: Any, **overrides: Any) -> Any:
    """``cfg`` (this spmdmoe's ``MoEConfig``) as ``moe_lib.MoEConfig`` (``moe_lib``: an ``spmdmoe.moe`` package,
    this one or an older copy): the fields that class has, then ``overrides``."""
    fields = {f.name for f in dataclasses.fields(moe_lib.MoEConfig)} - set(overrides)
    same = {k: v for k, v in dataclasses.asdict(cfg).items() if k in fields}
    return moe_lib.MoEConfig(**same, **overrides)
