"""Every number of a run's configuration bounded before anything is written.

Each config class checks its own values in `__post_init__`; this adds the checks that hold for
every field of a kind, by name and type, over the dataclasses the runner builds (RunConfig and
its model, the task, the probe's or experiment's config, nested ones too):

* a float (or each float of a list) is finite: NaN passes every `x < 0` check and inf every
  upper bound, and a run then ends with "no usable item" or a traceback after the work is done;
* a seed (`seed`, `*_seed`) lies in [0, 2**32 - 1], what numpy's generator accepts;
* `n_boot` >= 1 (a bootstrap of no resamples fails after every item was computed);
* any other count (`n_*`) and a `margin` are >= 0.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SEED_MAX = 2**32 - 1


def _value_problem(name: str, key: str, x: Any) -> str | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    if isinstance(x, float) and not math.isfinite(x):
        return f"{key} must be a finite number, got {x}"
    if (name == "seed" or name.endswith("_seed")) and not 0 <= x <= SEED_MAX:
        return f"{key} must be in [0, {SEED_MAX}], got {x}"
    if name == "n_boot" and x < 1:
        return f"{key} must be >= 1, got {x}"
    if (name.startswith("n_") or name == "margin") and x < 0:
        return f"{key} must be >= 0, got {x}"
    return None


def number_problem(obj: Any, where: str = "") -> str | None:
    """The first out-of-range number of dataclass instance `obj` (its key prefixed by `where`,
    e.g. "probe."), or None."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return None
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{where}{f.name}"
        problem = number_problem(value, f"{key}.")
        for x in value if isinstance(value, list | tuple) else [value]:
            problem = problem or _value_problem(f.name, key, x)
        if problem:
            return problem
    return None
