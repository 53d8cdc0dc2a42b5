"""Scheduling task graphs onto streams (pure Python, no CUDA).

``schedule(graph, policy, streams)`` -> `Plan` (streams, ordered steps, events);
``verify(plan, graph)`` -> hazards found; ``check(plan, graph)`` raises `HazardError`.
Hand-written plans: `PlanBuilder`.
"""

from orchestra.schedule.costs import CostModel, estimate_costs, estimate_makespan
from orchestra.schedule.events import insert_events
from orchestra.schedule.finding import KINDS, Finding
from orchestra.schedule.happens_before import GraphOrder, PlanOrder
from orchestra.schedule.plan import Plan, PlanBuilder, RecordEvent, RunNode, StreamSpec, WaitEvent
from orchestra.schedule.concurrent import fills_gpu
from orchestra.schedule.policies import CAPACITY_POLICIES, POLICIES, schedule
from orchestra.schedule.verify import check, verify, verify_graph_edges

__all__ = [
    "CAPACITY_POLICIES", "CostModel", "Finding", "GraphOrder", "KINDS", "POLICIES", "Plan", "PlanBuilder", "PlanOrder",
    "RecordEvent", "RunNode", "StreamSpec", "WaitEvent", "check", "estimate_costs",
    "estimate_makespan", "fills_gpu", "insert_events", "schedule", "verify", "verify_graph_edges",
]
