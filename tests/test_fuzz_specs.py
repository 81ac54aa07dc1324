"""Fuzzing the spec front end: whatever the text, the only errors are SpecError and PlanError.

Three sources of specs, each checked by Hypothesis:

- arbitrary text (any unicode, including control characters and line breaks);
- token soup: lines assembled from the language's own words, names, numbers
  and punctuation, which gets much further into the parser than random text;
- mutated valid specs (every spec in specs/ and a few more): characters
  deleted or inserted, numbers replaced by edge values, words swapped for
  other keywords, lines dropped, duplicated or swapped. What parses is then
  resolved against the model it was written for, at a drawn global batch.

A parser or resolver that raises anything else (IndexError, KeyError, a lark
exception, an assert) fails the test with the shrunk spec. Models are traced
once per module on the `meta` device. The counters at the bottom give the
figures for the README's reliability section (pytest -s prints them).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import examples
from hypothesis import given
from hypothesis import strategies as st

from parc.compiler.model import load_model
from parc.compiler.resolve import resolve
from parc.compiler.trace import propagate_shapes, trace_model
from parc.dsl import parse_spec
from parc.errors import PlanError, SpecError

ROOT = Path(__file__).parent.parent
ENV = {
    "GPT_LAYERS": "4",
    "GPT_DIM": "32",
    "GPT_HEADS": "2",
    "GPT_VOCAB": "64",
    "GPT_SEQ": "8",
    "MLP_LAYERS": "4",
    "MLP_DIM": "16",
    "MLP_OUT": "4",
    "LLAMA_LAYERS": "2",
    "LLAMA_DIM": "32",
    "LLAMA_HEADS": "4",
    "LLAMA_KV_HEADS": "2",
    "LLAMA_VOCAB": "64",
    "LLAMA_SEQ": "8",
    "LLAMA_FFN": "64",
}
EXTRA_VALID = {  # beyond specs/: features the shipped specs do not use
    "gpt": [
        "mesh pp=2\nstage layers[0:2] -> 0\nstage layers[2:4] -> 1\nrecompute layers[*].mlp\n",
        "mesh dp=2 tp=2\nshard *.mlp.fc1 col tp\nshard *.mlp.fc2 row tp\ngrad_accum 2\nzero 3\n",
        "mesh pp=4\nstage auto\nmicrobatches 4\nschedule gpipe\n",
    ],
    "mlp": ["mesh dp=4\nzero 2\n", "mesh pp=2 tp=2\nshard layers[0] col tp\nstage auto\n"],
}
WORDS = [
    *("mesh", "shard", "stage", "microbatches", "schedule", "zero", "grad_accum", "recompute"),
    *("col", "row", "vocab", "auto", "gpipe", "1f1b", "dp", "tp", "pp", "mp", "ep"),
    *("layers", "wte", "wpe", "lm_head", "ln_f", "*.attn.qkv", "*.mlp.fc1", "head", "attn"),
]
NUMBERS = ["0", "1", "2", "3", "4", "7", "8", "-1", "2.5", "1e3", "99999999999999999999", "00"]
PUNCTUATION = ["=", "->", ",", "[", "]", ":", ".", "*", "#", " ", "  ", "\t", "\n", "\r"]
TRIED: Counter[str] = Counter()  # outcome -> examples, over this module


@dataclass(frozen=True)
class Traced:
    model: torch.nn.Module
    gm: torch.fx.GraphModule


def _valid_specs() -> list[tuple[str, str]]:
    """(model key, spec text) for every spec in specs/ and the extra ones above."""
    found = []
    for path in sorted((ROOT / "specs").glob("*.par")):
        text = path.read_text()
        declared = re.search(r"#\s*model:\s*examples/(\w+)\.py", text)
        found.append((declared.group(1) if declared else path.stem.split("_")[0], text))
    found += [(model, text) for model, texts in EXTRA_VALID.items() for text in texts]
    return [(model, text) for model, text in found if model in MODEL_FILES]


MODEL_FILES = {"gpt": "examples/gpt.py", "mlp": "examples/mlp.py", "llama": "examples/llama.py"}
VALID = _valid_specs()  # specs for other models (not traced here) are left out


@pytest.fixture(scope="module")
def traced() -> dict[str, Traced]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in ENV.items():
            mp.setenv(key, value)
        out = {}
        for key, file in MODEL_FILES.items():
            source = load_model(ROOT / file)
            model = source.build(device="meta")
            gm = trace_model(model)
            inputs, _ = source.batch(2, 0)
            propagate_shapes(gm, inputs if isinstance(inputs, tuple) else (inputs,))
            out[key] = Traced(model, gm)
    return out


def _parse_only_spec_errors(text: str) -> object | None:
    """The parsed spec, or None after a SpecError; any other exception fails the test."""
    try:
        spec = parse_spec(text, "fuzz.par")
    except SpecError as err:
        assert err.span is None or err.span.line >= 1, str(err)
        str(err)  # formatting the message must not fail either
        TRIED["parse: SpecError"] += 1
        return None
    TRIED["parse: ok"] += 1
    return spec


# ---------------------------------------------------------------- strategies

token_lines = st.lists(
    st.lists(st.sampled_from(WORDS + NUMBERS + PUNCTUATION), max_size=8).map(" ".join),
    max_size=6,
).map("\n".join)


@st.composite
def mutated_spec(draw: st.DrawFn) -> tuple[str, str]:
    """A valid spec with 1 to 4 mutations (see the module docstring), and its model key."""
    model, text = draw(st.sampled_from(VALID))
    for _ in range(draw(st.integers(1, 4))):
        lines = text.split("\n")
        kind = draw(st.sampled_from(["delete", "insert", "number", "word", "lines"]))
        at = draw(st.integers(0, max(0, len(text) - 1)))
        if kind == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 6)) :]
        elif kind == "insert":
            piece = draw(st.sampled_from(WORDS + NUMBERS + PUNCTUATION) | st.text(max_size=3))
            text = text[:at] + piece + text[at:]
        elif kind == "number" and (numbers := list(re.finditer(r"\d+", text))):
            m = draw(st.sampled_from(numbers))
            text = text[: m.start()] + draw(st.sampled_from(NUMBERS)) + text[m.end() :]
        elif kind == "word" and (words := list(re.finditer(r"[A-Za-z_]\w*", text))):
            m = draw(st.sampled_from(words))
            text = text[: m.start()] + draw(st.sampled_from(WORDS)) + text[m.end() :]
        else:
            i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            how = draw(st.sampled_from(["drop", "duplicate", "swap"]))
            if how == "drop":
                del lines[i]
            elif how == "duplicate":
                lines.insert(j, lines[i])
            else:
                lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
    return model, text


# ---------------------------------------------------------------- tests


@examples(500)
@given(text=st.text(max_size=200))
def test_arbitrary_text_is_parsed_or_a_spec_error(text: str) -> None:
    _parse_only_spec_errors(text)


@examples(500)
@given(text=token_lines)
def test_token_soup_is_parsed_or_a_spec_error(text: str) -> None:
    _parse_only_spec_errors(text)


@examples(1000)
@given(case=mutated_spec(), batch=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32]))
def test_mutated_specs_are_spec_or_plan_errors_when_resolved(
    traced: dict[str, Traced], case: tuple[str, str], batch: int
) -> None:
    model, text = case
    spec = _parse_only_spec_errors(text)
    if spec is None:
        return
    t = traced[model]
    try:
        resolve(spec, t.model, t.gm, batch=batch)  # type: ignore[arg-type]
    except PlanError as err:
        str(err)
        TRIED["resolve: PlanError"] += 1
        return
    except SpecError as err:
        str(err)
        TRIED["resolve: SpecError"] += 1
        return
    TRIED["resolve: ok"] += 1


def test_every_valid_spec_resolves_before_mutation(traced: dict[str, Traced]) -> None:
    # The mutations start from specs that are valid: otherwise the fuzz tests
    # would exercise errors only.
    assert len(VALID) >= 10
    for model, text in VALID:
        t = traced[model]
        spec = parse_spec(text, "valid.par")
        resolve(spec, t.model, t.gm, batch=16)


def test_the_fuzzers_reached_both_outcomes() -> None:
    # Run after the fuzz tests (file order): a fuzzer that only ever produced
    # errors, or never did, would test far less than it claims.
    if not TRIED:
        pytest.skip("run with the fuzz tests above")
    tried = TRIED["parse: ok"] + TRIED["parse: SpecError"]
    print(f"\nspecs tried by the fuzzers: {tried}", dict(TRIED))
    assert TRIED["parse: SpecError"] > 0 and TRIED["parse: ok"] > 0
    assert TRIED["resolve: PlanError"] > 0 and TRIED["resolve: ok"] > 0
