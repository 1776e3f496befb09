"""Router placement core: pure filters -> weighted scorers -> picker over one RoutingContext,
plus the prefix indexes and health tracking that feed it. No I/O, no asyncio."""
from router.placement.context import build_context
from router.placement.filters import FILTERS, Filter
from router.placement.health import (
    BreakerConfig,
    CircuitBreaker,
    HealthConfig,
    HealthTracker,
)
from router.placement.pipeline import (
    DEFAULT_FILTERS,
    DEFAULT_WEIGHTS,
    PICKERS,
    Decision,
    MaxScorePicker,
    NoWorkerAvailable,
    Pick,
    Pipeline,
    WeightedScorer,
    build_pipeline,
    decide_disaggregation,
)
from router.placement.prefix_index import (
    ApproximatePrefixIndex,
    PrefixIndex,
    PrefixQuery,
)
from router.placement.scorers import SCORERS, Scorer, clamp01, run_scorer
from router.placement.types import CircuitState, HashKey, RoutingContext, WorkerState

__all__ = [
    "DEFAULT_FILTERS", "DEFAULT_WEIGHTS", "FILTERS", "PICKERS", "SCORERS",
    "ApproximatePrefixIndex", "BreakerConfig", "CircuitBreaker", "CircuitState", "Decision", "Filter",
    "HashKey", "HealthConfig", "HealthTracker", "MaxScorePicker", "NoWorkerAvailable", "Pick", "Pipeline",
    "PrefixIndex", "PrefixQuery", "RoutingContext", "Scorer", "WeightedScorer", "WorkerState",
    "build_context", "build_pipeline", "clamp01", "decide_disaggregation", "run_scorer",
]
