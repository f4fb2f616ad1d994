"""What the two gated layout experiments (`distance`, `order`) share: the checks of their patch
settings and the building of every (item, cell) of a gated field suite, with each bad setting
one ConfigError before any forward pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvnotes.errors import ConfigError
from kvnotes.models import budget
from kvnotes.tasks.item import TaskItem

if TYPE_CHECKING:
    from experiments.shared.context import Context


def check_patch_settings(margin: float | None, batch_size: int | None, n_boot: int) -> None:
    """margin >= 0 or None (the model's), batch_size >= 1 or None (from free memory), n_boot >= 1."""
    if margin is not None and not margin >= 0:
        raise ConfigError(f"margin must be >= 0 or null, got {margin}")
    if (batch_size is not None and batch_size < 1) or n_boot < 1:
        raise ConfigError("batch_size and n_boot must be >= 1")


def layout_items(ctx: Context, name: str, build: Callable[..., list[TaskItem]], smaller: str,
                 **kwargs: Any) -> list[TaskItem]:
    """`build(tokenizer=, chat=, **task kwargs, **kwargs)` over the run's gated task (its `length`
    dropped: each cell has its own, unless `kwargs` gives one; its seed the run's unless pinned); a ValueError, or a prompt
    longer than the model's positions, is one ConfigError naming the experiment (`smaller`: what
    to shrink)."""
    task = ctx.cfg.task
    if task is None:
        raise ConfigError(f"experiment {name} needs a gated task suite: add task=<suite>")
    kw = task.build_kwargs()  # a GatedTask (runner.task_config), validated
    kw.pop("length")
    kw.update(kwargs)
    if kw["seed"] is None:  # the run's seed draws the suite unless the task pins one
        kw["seed"] = ctx.cfg.seed
    try:
        items = build(tokenizer=ctx.model.tokenizer, chat=ctx.chat, **kw)
    except ValueError as e:
        raise ConfigError(f"experiment {name}: {e}") from None
    longest = max(it.n_tokens for it in items)
    shape = budget.model_shape(ctx.cfg.model.name, ctx.cfg.model.tiny_family, ctx.cfg.cache_dir)
    if shape is not None and shape.max_positions is not None and longest > shape.max_positions:
        raise ConfigError(f"experiment {name}: prompts of {longest} tokens exceed the {shape.max_positions} "
                          f"positions of model {ctx.cfg.model.name} ({shape.source}); use {smaller}")
    return items
