"""DCP's save planner with a global step that stays linear in the rank count.

``DefaultSavePlanner._create_global_plan`` merges the ranks' ``planner_data``
with ``dict(ChainMap(*mappings))``: each key is looked up through the mappings
in order, and ``TrainState`` gives every rank a key of its own (``ranks.<r>``),
so rank r's key passes r mappings: quadratic in the rank count (0.82 s at
2,048 ranks, 2 to 3 s at 4,096; ``benchmarks/scale.py``). The same merge with
``dict.update`` (first mapping wins, as in the ``ChainMap``) is linear.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner


def merge_planner_data(mappings: list[dict]) -> dict:
    """``dict(ChainMap(*mappings))`` in one pass: for a key in several mappings the first one's value wins."""
    merged: dict = {}
    for mapping in reversed(mappings):
        merged.update(mapping)
    return merged


class LinearMergePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose global plan merges the planner data linearly (``merge_planner_data``)."""

    def _create_global_plan(self, all_plans: list) -> tuple[list, Any]:
        flatten = self.flatten_state_dict
        self.flatten_state_dict = False  # the base class then skips its quadratic merge
        try:
            global_plan, metadata = super()._create_global_plan(all_plans)
        finally:
            self.flatten_state_dict = flatten
        if flatten:
            merged = merge_planner_data([p.planner_data for p in global_plan])
            metadata = dataclasses.replace(metadata, planner_data=merged)
        return global_plan, metadata
