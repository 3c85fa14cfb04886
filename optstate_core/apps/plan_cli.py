"""The ``optstate plan`` command: the table of what fits (:mod:`.plan`), then the one-GPU recipe (:mod:`.recipe`)."""
from __future__ import annotations

from . import plan, recipe


def add_arguments(parser) -> None:
    """Every option of ``optstate plan``."""
    plan.add_arguments(parser)
    recipe.add_arguments(parser)


def run(args) -> int:
    """Print the table, and the recipe where one applies (its argument checks come before any output)."""
    rec = recipe.recipe_from_args(args)
    print(plan.format_plan(plan.plan_from_args(args)))
    if rec is not None:
        print("\n" + recipe.format_recipe(rec))
    return 0
