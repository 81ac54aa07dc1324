"""The planner behind `parc plan`: a memory and time estimate for every spec a cluster allows.

cluster.py        --cluster text and GPU presets
model_profile.py  per-unit costs of a model from one trace on the meta device
unit_costs.py     those costs at one tensor-parallel size (UnitCostModel.at)
search.py         enumerate specs, cost each analytically, rank those that fit
time_model.py     compute at a sustained rate, collectives at per-axis bandwidths
advise.py         plan_model: the three above, end to end
format.py         the report and the best spec as `.par`
"""

from .advise import PlanResult, plan_model
from .cluster import PRESETS, Cluster, parse_cluster

__all__ = ["PRESETS", "Cluster", "PlanResult", "parse_cluster", "plan_model"]
