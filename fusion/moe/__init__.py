"""Whole MoE layers: device-side routing (`route`), the row movers behind Gather/Combine, and `MoE`.

See docs/user-guide.md ("MoE layers") for the routing rules, token rounding and padding rows.
"""
from fusion.moe.layer import MoE
from fusion.moe.routing import RouteResult, capacity, route
from fusion.ops.routing import combine_rows as combine
from fusion.ops.routing import gather_rows as gather
from fusion.ops.routing import token_layout

__all__ = ["route", "RouteResult", "capacity", "gather", "combine", "token_layout", "MoE"]
