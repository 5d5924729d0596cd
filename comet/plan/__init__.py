"""Expert placement: which ranks hold which experts, and the planners that choose it.

* :class:`Placement` -- per logical expert the group ranks holding a replica;
  :func:`choose_replica` / :func:`route_table` -- which replica serves a source rank's rows.
* :class:`ExpertLoad` -- routing histograms accumulated over steps; :func:`zipf_loads` -- skewed
  synthetic loads.
* :func:`lysi_group`, :func:`lysi_assign` -- the Lysi paper's grouping and assignment;
  :func:`balance` -- EPLB-like replication of hot experts.
* :mod:`comet.plan.skew` -- the cost model's per-rank rows under skew (the slowest rank).

* :func:`migrate` -- move expert weights (and optimiser state) to a new placement, one collective.

The ops take a placement with ``placement=`` (comet/layers/placed.py).
User guide: docs/placement.md.
"""

from .balance import balance
from .load import ExpertLoad, parse_skew, zipf_loads
from .lysi import group_objective, lysi_assign, lysi_assign_visits, lysi_group
from .migrate import migrate, migration_sources
from .placement import Placement, choose_replica, route_table

__all__ = ["Placement", "choose_replica", "route_table", "ExpertLoad", "zipf_loads",
           "parse_skew", "lysi_group", "lysi_assign", "lysi_assign_visits", "group_objective",
           "balance", "migrate", "migration_sources"]
