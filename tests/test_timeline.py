"""SVG drawing of a simulated pipeline timeline (runtime/pipeline/timeline.py)."""

from __future__ import annotations

import doctest
import xml.etree.ElementTree as ET

import pytest

from parc.compiler.schedule import ActionKind, gpipe, lower_comms, one_f_one_b
from parc.compiler.schedule_sim import simulate
from parc.runtime.pipeline import timeline as timeline_module
from parc.runtime.pipeline.timeline import timeline_svg

SVG = "{http://www.w3.org/2000/svg}"
_COMPUTE = (ActionKind.F, ActionKind.B)


def boxes(root: ET.Element, kind: ActionKind) -> list[ET.Element]:
    """The <g> drawn for each `kind` action: a <rect> and a <text> with the microbatch."""
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == kind.value]


def rect(box: ET.Element) -> ET.Element:
    found = box.find(f"{SVG}rect")
    assert found is not None
    return found


def test_svg_is_standalone_xml_with_one_box_per_compute_action() -> None:
    root = ET.fromstring(timeline_svg(simulate(lower_comms(one_f_one_b(3, 5)))))
    assert root.tag == f"{SVG}svg" and root.get("viewBox")
    assert len(boxes(root, ActionKind.F)) == len(boxes(root, ActionKind.B)) == 3 * 5


def test_forward_and_backward_boxes_differ_in_colour_and_carry_the_microbatch() -> None:
    root = ET.fromstring(timeline_svg(simulate(gpipe(2, 3))))
    fills = {kind: {rect(g).get("fill") for g in boxes(root, kind)} for kind in _COMPUTE}
    assert len(fills[ActionKind.F]) == len(fills[ActionKind.B]) == 1
    assert fills[ActionKind.F] != fills[ActionKind.B]
    assert (boxes(root, ActionKind.B)[0].findtext(f"{SVG}title") or "").startswith("0B0: backward")
    labels = sorted(g.findtext(f"{SVG}text") or "" for g in boxes(root, ActionKind.F))
    assert labels == ["0", "0", "1", "1", "2", "2"]


def test_idle_time_is_left_blank() -> None:
    unit = 10
    timeline = simulate(gpipe(3, 2), backward_cost=2)
    root = ET.fromstring(timeline_svg(timeline, unit=unit))
    drawn = sum(float(rect(g).get("width", "nan")) for kind in _COMPUTE for g in boxes(root, kind))
    busy = sum(s.end - s.start for r in timeline.slots for s in timeline.compute(r))
    assert drawn == busy * unit < len(timeline.slots) * timeline.makespan * unit


@pytest.mark.parametrize("stages, microbatches, shown", [(4, 8, "27.3%"), (2, 1, "50.0%")])
def test_title_states_the_bubble_fraction(stages: int, microbatches: int, shown: str) -> None:
    svg = timeline_svg(simulate(one_f_one_b(stages, microbatches)), title="run")
    assert ET.fromstring(svg).findtext(f"{SVG}title") == f"run — bubble {shown}"


def test_title_is_escaped() -> None:
    svg = timeline_svg(simulate(gpipe(2, 2)), title='a <b> & "c"')
    assert (ET.fromstring(svg).findtext(f"{SVG}title") or "").startswith('a <b> & "c"')


def test_docstring_example_runs() -> None:
    result = doctest.testmod(timeline_module)
    assert result.attempted > 0 and result.failed == 0
