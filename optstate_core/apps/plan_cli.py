"""The ``optstate plan`` command: the table of what fits (:mod:`.plan`), then the one-GPU recipe (:mod:`.recipe`)
and, with ``--stream-weights``, the weight-streaming plan (:mod:`.plan_stream`)."""
from __future__ import annotations

from . import plan, plan_stream, recipe


def add_arguments(parser) -> None:
    """Every option of ``optstate plan``."""
    plan.add_arguments(parser)
    recipe.add_arguments(parser)
    plan_stream.add_arguments(parser)


def run(args) -> int:
    """Print the table, the recipe where one applies and the streaming plan if asked for (their argument
    checks come before any output)."""
    rec = recipe.recipe_from_args(args)
    stream = plan_stream.stream_from_args(args)
    print(plan.format_plan(plan.plan_from_args(args)))
    if rec is not None:
        print("\n" + recipe.format_recipe(rec))
    if stream is not None:
        print("\n" + plan_stream.format_stream(stream))
    return 0
