"""The `.par` language: grammar, parser, AST and pattern matching (docs/architecture.md, Language).

Knows nothing of torch. `parse_spec`/`load_spec` give a `Spec`; patterns in it
are matched against module qualified names with `match_names`.
"""

from parc.dsl import ast
from parc.dsl.ast import *  # noqa: F403  (ast.py's __all__, listed once there)
from parc.dsl.parser import STATEMENT_KEYWORDS, load_spec, parse_spec
from parc.dsl.patterns import (
    anchored_names,
    match_names,
    pattern_matches,
    pattern_width,
    suggest,
)

__all__ = [
    "STATEMENT_KEYWORDS",
    "anchored_names",
    "load_spec",
    "match_names",
    "parse_spec",
    "pattern_matches",
    "pattern_width",
    "suggest",
]
__all__ += ast.__all__
