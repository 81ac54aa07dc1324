"""The `.par` language: grammar, parser, AST and pattern matching (docs/architecture.md, Language).

Knows nothing of torch. `parse_spec`/`load_spec` give a `Spec`; patterns in it
are matched against module qualified names with `match_names`.
"""

from parc.dsl.ast import (
    AXIS_DP,
    AXIS_PP,
    AXIS_TP,
    Axis,
    GradAccum,
    IndexAll,
    IndexRange,
    Mesh,
    Microbatches,
    Name,
    Pattern,
    Recompute,
    Schedule,
    ScheduleKind,
    Segment,
    Shard,
    ShardKind,
    Span,
    Spec,
    Stage,
    StageAuto,
    Star,
    Statement,
    Zero,
)
from parc.dsl.parser import STATEMENT_KEYWORDS, load_spec, parse_spec
from parc.dsl.patterns import match_names, pattern_matches, pattern_width, suggest

__all__ = [
    "AXIS_DP",
    "AXIS_PP",
    "AXIS_TP",
    "STATEMENT_KEYWORDS",
    "Axis",
    "GradAccum",
    "IndexAll",
    "IndexRange",
    "Mesh",
    "Microbatches",
    "Name",
    "Pattern",
    "Recompute",
    "Schedule",
    "ScheduleKind",
    "Segment",
    "Shard",
    "ShardKind",
    "Span",
    "Spec",
    "Stage",
    "StageAuto",
    "Star",
    "Statement",
    "Zero",
    "load_spec",
    "match_names",
    "parse_spec",
    "pattern_matches",
    "pattern_width",
    "suggest",
]
