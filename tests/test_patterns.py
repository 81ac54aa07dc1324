"""Pattern matching over module qualified names, and did-you-mean suggestions."""

from __future__ import annotations

import pytest

from parc.dsl import (
    IndexAll,
    IndexRange,
    Name,
    Pattern,
    Recompute,
    Star,
    match_names,
    parse_spec,
    pattern_matches,
    pattern_width,
    suggest,
)

# The qualified names of a small GPT (leaf and non-leaf modules).
GPT = [
    "wte",
    "wpe",
    *(
        f"layers.{i}{suffix}"
        for i in range(12)
        for suffix in (
            "",
            ".ln_1",
            ".attn",
            ".attn.qkv",
            ".attn.proj",
            ".ln_2",
            ".mlp",
            ".mlp.fc1",
            ".mlp.fc2",
        )
    ),
    "layers.0.mlp.fc10",  # a trap for prefix matching
    "ln_f",
    "lm_head",
]


def pat(text: str) -> Pattern:
    statement = parse_spec(f"recompute {text}").statements[0]
    assert isinstance(statement, Recompute)
    return statement.pattern


@pytest.mark.parametrize(
    ("pattern", "name"),
    [
        ("mlp.fc1", "layers.3.mlp.fc1"),
        ("fc1", "layers.3.mlp.fc1"),
        ("layers.3.mlp.fc1", "layers.3.mlp.fc1"),
        ("3.mlp", "layers.3.mlp"),
        ("*", "wte"),
        ("*.attn.qkv", "layers.0.attn.qkv"),
        ("layers.*.attn", "layers.11.attn"),
        ("layers[0:6]", "layers.0"),
        ("layers[0:6]", "layers.5"),
        ("layers[0:6].mlp", "layers.2.mlp"),
        ("layers[*]", "layers.11"),
        ("layers[*].mlp.fc2", "layers.7.mlp.fc2"),
        ("layers[3]", "layers.3"),
        ("model.layers[2:4]", "model.layers.3"),
    ],
)
def test_pattern_matches(pattern: str, name: str) -> None:
    assert pattern_matches(pat(pattern), name)


@pytest.mark.parametrize(
    ("pattern", "name"),
    [
        ("mlp.fc1", "layers.0.mlp.fc10"),  # segments are whole words, not prefixes
        ("mlp.fc1", "layers.0.mlp"),  # a suffix of the pattern is not enough
        ("mlp", "layers.0.mlp.fc1"),  # the pattern must match the end of the name
        ("fc", "layers.0.mlp.fc1"),
        ("layers[0:2]", "layers.0.attn"),
        ("layers[0:2]", "layers.2"),
        ("layers[0:6]", "layers.x"),
        ("layers[*]", "layers.ln"),
        ("layers[*]", "layers"),
        ("*.wte", "wte"),  # '*' needs one segment to match
        ("layers.1", "layers.10"),
        ("layers[3]", "layers.03"),
        ("layers[0:6]", "layers.²"),  # str.isdigit() is true, int() would fail
        ("h.attn", "layers.0.attn"),
    ],
)
def test_pattern_does_not_match(pattern: str, name: str) -> None:
    assert not pattern_matches(pat(pattern), name)


def test_the_empty_pattern_matches_nothing() -> None:
    assert not pattern_matches(Pattern(()), "wte")
    assert not pattern_matches(Pattern(()), "")


def test_pattern_width_counts_name_segments() -> None:
    assert pattern_width(pat("layers[0:2].mlp")) == 3
    assert pattern_width(pat("*.x")) == 2
    assert pattern_width(Pattern((IndexAll("h"), Star(), Name("a")))) == 4


def test_match_names_keeps_input_order() -> None:
    names = ["b.mlp.fc1", "a.mlp.fc1", "c.mlp.fc2", "a.mlp.fc10"]
    assert match_names(pat("mlp.fc1"), names) == ["b.mlp.fc1", "a.mlp.fc1"]
    assert match_names(pat("mlp.fc1"), iter(names)) == ["b.mlp.fc1", "a.mlp.fc1"]


def test_match_names_over_a_model() -> None:
    assert match_names(pat("layers[0:2].mlp.fc1"), GPT) == ["layers.0.mlp.fc1", "layers.1.mlp.fc1"]
    assert len(match_names(pat("*.attn.qkv"), GPT)) == 12
    assert len(match_names(pat("layers[*]"), GPT)) == 12
    assert match_names(pat("layers[10:12]"), GPT) == ["layers.10", "layers.11"]
    assert match_names(pat("fc10"), GPT) == ["layers.0.mlp.fc10"]


def test_index_range_bounds_are_start_inclusive_stop_exclusive() -> None:
    pattern = Pattern((IndexRange("layers", 6, 12),))
    assert match_names(pattern, [f"layers.{i}" for i in range(14)]) == [
        f"layers.{i}" for i in range(6, 12)
    ]


# ---------------------------------------------------------------- suggestions


def test_suggest_fixes_a_typo_in_the_last_segment() -> None:
    assert suggest(pat("mlp.fc3"), GPT) == ["mlp.fc1", "mlp.fc2"]


def test_suggest_fixes_a_doubled_letter() -> None:
    assert suggest(pat("attn.qkvv"), GPT)[0] == "attn.qkv"


def test_suggest_keeps_wildcards_and_ranges() -> None:
    assert suggest(pat("*.attn.qkvv"), GPT)[0] == "*.attn.qkv"
    assert suggest(pat("layer[0:6].mlp"), GPT)[0] == "layers[0:6].mlp"
    assert suggest(pat("layer[*]"), GPT)[0] == "layers[*]"


def test_suggest_finds_full_names_of_another_depth() -> None:
    assert "lm_head" in suggest(pat("lmhead"), GPT)
    assert suggest(pat("layers0.mlp"), ["layers.0.mlp", "wte"]) == ["layers.0.mlp"]


def test_suggest_only_offers_patterns_that_match_something() -> None:
    # layers[12:14] is out of range, not misspelt: no rewritten range is offered
    candidates = suggest(pat("layers[12:14].mlp"), GPT) + suggest(pat("layer[0:6].mlp"), GPT)
    assert candidates
    for candidate in candidates:
        assert match_names(pat(candidate), GPT), candidate
    assert not any("[12:14]" in candidate for candidate in candidates)


def test_suggest_never_offers_the_pattern_itself() -> None:
    assert "layers[20:30]" not in suggest(pat("layers[20:30]"), GPT)


def test_suggest_returns_nothing_for_unrelated_names() -> None:
    assert suggest(pat("decoder.xyz"), GPT) == []
    assert suggest(pat("fc1"), []) == []


def test_suggest_respects_n() -> None:
    assert len(suggest(pat("mlp.fc3"), GPT, n=1)) == 1
    assert len(suggest(pat("mlp.fc3"), GPT, n=10)) <= 10
