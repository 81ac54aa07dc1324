"""Pipeline schedules: generation, lowering, simulation and validation (compiler/schedule*.py)."""

from __future__ import annotations

import doctest
import itertools
from typing import cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parc.compiler import schedule as schedule_module
from parc.compiler import schedule_actions, schedule_grid, schedule_sim, schedule_split
from parc.compiler.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    Timeline,
    bubble_fraction,
    execution_items,
    format_grid,
    generate,
    gpipe,
    lower_comms,
    one_f_one_b,
    peak_in_flight,
    peer_rank,
    stage_in_flight,
)
from parc.compiler.schedule_sim import simulate, validate
from parc.dsl.ast import ScheduleKind
from parc.errors import ParcError

SIZES = list(itertools.product(range(1, 7), range(1, 10)))  # (stages, microbatches)
# The schedules of F and B; zb1 splits B and W and has its own bubble
# (tests/test_zero_bubble_schedule.py).
KINDS = [k for k in ScheduleKind if k is not ScheduleKind.ZB1]
# The schedules whose ranks merge their stages' own orders by start time; interleaved
# 1F1B is one order per rank, proven in tests/test_interleaved_schedule.py.
MERGED = [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B]


def plan(*rows: str) -> Schedule:
    """A schedule written as one line of actions per rank: plan("0F0 0B0", "1F0 1B0")."""
    return {rank: [Action.parse(t) for t in row.split()] for rank, row in enumerate(rows)}


def rejected(schedule: Schedule, stages: int, microbatches: int) -> str:
    return rejected_on(schedule, stages, microbatches, None)


def rejected_on(
    schedule: Schedule, stages: int, microbatches: int, stage_to_rank: tuple[int, ...] | None
) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(schedule, stages, microbatches, stage_to_rank)
    text = str(info.value)
    assert info.value.grid and info.value.grid.splitlines()[0] in text, "the grid is in the message"
    return text


# ---------------------------------------------------------------- actions


@given(st.builds(Action, st.integers(0, 10**6), st.sampled_from(ActionKind), st.integers(0, 10**6)))
def test_action_prints_and_parses_back(action: Action) -> None:
    assert Action.parse(str(action)) == action
    assert repr(action) == str(action)


@given(st.text(max_size=12))
def test_parse_either_reads_an_action_or_raises_schedule_error(text: str) -> None:
    try:
        action = Action.parse(text)
    except ScheduleError as e:
        assert "<stage><kind><microbatch>" in str(e)
    else:
        assert Action.parse(str(action)) == action


def test_action_text_is_compact() -> None:
    assert str(Action(1, ActionKind.F, 3)) == "1F3"
    assert str(Action(2, ActionKind.RECV_B, 0)) == "2RECV_B0"
    assert Action.parse("1SEND_F3") == Action(1, ActionKind.SEND_F, 3)


@pytest.mark.parametrize("text", ["", "F3", "1X3", "1F", "1 F 3", "1f3", "-1F3", "1F3x"])
def test_parse_rejects_bad_text_with_a_schedule_error(text: str) -> None:
    with pytest.raises(ScheduleError, match="not a pipeline action"):
        Action.parse(text)
    assert issubclass(ScheduleError, ParcError)


# ---------------------------------------------------------------- generators


def test_gpipe_runs_all_forwards_then_backwards_in_microbatch_order() -> None:
    assert gpipe(2, 3) == plan("0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2")


def test_one_f_one_b_warms_up_alternates_and_cools_down() -> None:
    assert one_f_one_b(3, 4) == plan(
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    )


def test_one_f_one_b_with_fewer_microbatches_than_stages_is_gpipe_where_warmup_covers_all() -> None:
    schedule = one_f_one_b(4, 2)
    assert schedule[0] == gpipe(4, 2)[0]
    assert schedule[3] == plan("", "", "", "3F0 3B0 3F1 3B1")[3]


def test_generate_dispatches_on_the_spec_schedule_kind() -> None:
    assert generate(ScheduleKind.GPIPE, 3, 2) == gpipe(3, 2)
    assert generate(ScheduleKind.ONE_F_ONE_B, 3, 2) == one_f_one_b(3, 2)


def test_generate_rejects_an_unknown_kind() -> None:
    with pytest.raises(ScheduleError, match="'zb' is not a pipeline schedule; expected one of"):
        generate(cast(ScheduleKind, "zb"), 2, 2)


@pytest.mark.parametrize("stages, microbatches", [(0, 1), (1, 0), (-1, 4)])
def test_generate_rejects_empty_pipelines(stages: int, microbatches: int) -> None:
    with pytest.raises(ScheduleError, match="at least 1 stage and 1 microbatch"):
        generate(ScheduleKind.GPIPE, stages, microbatches)


# ---------------------------------------------------------------- lowering


def test_lowering_puts_each_send_and_next_receive_back_to_back() -> None:
    lowered = lower_comms(one_f_one_b(3, 3))
    assert (
        lowered[1]
        == plan(
            "",
            "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_B0 1B0 1SEND_B0 1RECV_F2 1F2 "
            "1SEND_F2 1RECV_B1 1B1 1SEND_B1 1RECV_B2 1B2 1SEND_B2",
        )[1]
    )
    assert lowered[0][:4] == plan("0F0 0SEND_F0 0F1 0SEND_F1")[0]


def test_lowering_is_pure_and_refuses_a_lowered_schedule() -> None:
    compute = one_f_one_b(3, 4)
    before = {r: list(a) for r, a in compute.items()}
    lowered = lower_comms(compute)
    assert compute == before
    with pytest.raises(ScheduleError, match="compute schedule"):
        lower_comms(lowered)


@pytest.mark.parametrize("kind", KINDS)
def test_every_lowered_batch_is_at_most_one_send_then_one_receive(kind: ScheduleKind) -> None:
    for stages, microbatches in SIZES:
        for actions in lower_comms(generate(kind, stages, microbatches)).values():
            for item in execution_items(actions):
                kinds = [actions[i].kind for i in item]
                assert len(kinds) <= 2 and not (len(kinds) == 2 and kinds[0].is_compute)
                if len(kinds) == 2:
                    assert kinds[0].is_send and not kinds[1].is_send


def test_one_stage_needs_no_comms() -> None:
    assert lower_comms(gpipe(1, 3)) == gpipe(1, 3)


# ---------------------------------------------------------------- every generated schedule


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stages, microbatches", SIZES)
def test_every_generated_schedule_validates_raw_and_lowered(
    kind: ScheduleKind, stages: int, microbatches: int
) -> None:
    compute = generate(kind, stages, microbatches)
    validate(compute, stages, microbatches)
    validate(lower_comms(compute), stages, microbatches)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stages, microbatches", SIZES)
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(
    kind: ScheduleKind, stages: int, microbatches: int
) -> None:
    compute = generate(kind, stages, microbatches)
    expected = (stages - 1) / (microbatches + stages - 1)
    assert bubble_fraction(simulate(compute)) == expected
    assert bubble_fraction(simulate(lower_comms(compute))) == expected
    # Uniform costs keep the formula: every slot of the ideal grid just gets longer.
    assert bubble_fraction(simulate(compute, backward_cost=2)) == pytest.approx(expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stages, microbatches", SIZES)
def test_batched_comms_cost_no_time_against_free_transfers(
    kind: ScheduleKind, stages: int, microbatches: int
) -> None:
    compute = generate(kind, stages, microbatches)
    free, lowered = simulate(compute), simulate(lower_comms(compute))
    assert all(free.compute(r) == lowered.compute(r) for r in compute)


@pytest.mark.parametrize("stages, microbatches", SIZES)
def test_peak_in_flight_is_m_for_gpipe_and_at_most_p_minus_stage_for_1f1b(
    stages: int, microbatches: int
) -> None:
    assert peak_in_flight(gpipe(stages, microbatches)) == dict.fromkeys(range(stages), microbatches)
    assert peak_in_flight(one_f_one_b(stages, microbatches)) == {
        s: min(stages - s, microbatches) for s in range(stages)
    }
    lowered = lower_comms(one_f_one_b(stages, microbatches))
    assert peak_in_flight(lowered) == peak_in_flight(one_f_one_b(stages, microbatches))


def test_simulated_times_respect_every_cross_stage_dependency() -> None:
    for kind, (stages, microbatches) in itertools.product(KINDS, SIZES):
        timeline = simulate(lower_comms(generate(kind, stages, microbatches)), backward_cost=2)
        end = {s.action: s.end for r in timeline.slots for s in timeline.compute(r)}
        for slot in (s for r in timeline.slots for s in timeline.compute(r)):
            a = slot.action
            step = -1 if a.kind is ActionKind.F else +1
            upstream = Action(a.stage + step, a.kind, a.microbatch)
            assert slot.start >= end.get(upstream, 0), (kind, stages, microbatches, a)


# ---------------------------------------------------------------- broken schedules


def test_rejects_a_missing_microbatch() -> None:
    schedule = gpipe(2, 3)
    schedule[1].remove(Action.parse("1B2"))
    text = rejected(schedule, 2, 3)
    assert "missing: rank 1 has no 1B2" in text


def test_rejects_a_duplicate_action_and_marks_both_copies() -> None:
    text = rejected(plan("0F0 0F1 0F1 0B0 0B1"), 1, 2)
    assert "duplicate: 0F1 appears twice on rank 0 (steps 1 and 2)" in text
    assert ">0F1< >0F1<" in text


def test_rejects_backward_before_forward() -> None:
    text = rejected(plan("0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"), 2, 2)
    assert "order: 1B0 (step 0) comes before 1F0 (step 1) on rank 1" in text
    assert "backward needs the activations of its forward" in text
    assert ">1B0<" in text


def test_rejects_a_compute_schedule_whose_stage_order_cannot_be_met() -> None:
    # Rank 0 wants 1B0 before running 0F1; rank 1 wants 0F1 before reaching 1B0.
    text = rejected(plan("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"), 2, 2)
    assert "deadlock" in text and "previous stage's F" in text
    assert "0B0 needs 1B0 from rank 1" in text and "1F1 needs 0F1 from rank 0" in text
    assert ">0B0<" in text and ">1F1<" in text


def test_rejects_a_forward_that_runs_before_its_input_arrives() -> None:
    schedule = lower_comms(gpipe(2, 1))
    schedule[1] = plan("", "1F0 1RECV_F0 1B0 1SEND_B0")[1]
    text = rejected(schedule, 2, 1)
    assert "1F0 (step 0) comes before 1RECV_F0 (step 1)" in text
    assert "activation from the previous stage" in text


def test_rejects_a_send_without_its_receive() -> None:
    schedule = lower_comms(gpipe(2, 2))
    schedule[1].remove(Action.parse("1RECV_F1"))
    text = rejected(schedule, 2, 2)
    assert "rank 1 has no 1RECV_F1, so 0SEND_F1 has no matching receive" in text


def test_simulate_rejects_a_send_without_its_receive() -> None:
    with pytest.raises(ScheduleError, match="0SEND_F0 on rank 0 has no matching receive") as e:
        simulate(plan("0F0 0SEND_F0", "1F0"))
    assert e.value.grid and ">0SEND_F0<" in e.value.grid


def test_rejects_sends_and_receives_that_pair_up_different_microbatches() -> None:
    # Stage 1 takes microbatch 1 first, but channel 0→1 delivers in send order.
    schedule = plan(
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F1 1F1 1RECV_F0 1F0 1B0 1SEND_B0 1B1 1SEND_B1",
    )
    text = rejected(schedule, 2, 2)
    assert "mismatched microbatch on channel 0→1" in text
    assert "send #0 is 0SEND_F0 but receive #0 is 1RECV_F1" in text
    assert ">0SEND_F0<" in text and ">1RECV_F1<" in text


def test_rejects_a_compute_schedule_whose_lowering_mismatches() -> None:
    text = rejected(plan("0F0 0F1 0B0 0B1", "1F1 1F0 1B1 1B0"), 2, 2)
    assert "after lower_comms: mismatched microbatch on channel 0→1" in text


def test_rejects_two_blocking_comms_in_opposite_order() -> None:
    # Rank 0 waits for a gradient before it sends activation 1; rank 1 waits for
    # activation 1 before it sends that gradient.
    schedule = plan(
        "0F0 0SEND_F0 0F1 0RECV_B0 0B0 0SEND_F1 0RECV_B1 0B1",
        "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
    )
    text = rejected(schedule, 2, 2)
    assert "deadlock: no rank can proceed" in text
    assert "0RECV_B0 waits for 1SEND_B0 (rank 1, step 5), but rank 1 is stuck at step 2" in text
    assert "1RECV_F1 waits for 0SEND_F1 (rank 0, step 5), but rank 0 is stuck at step 3" in text
    assert ">0RECV_B0<" in text and ">1RECV_F1<" in text
    assert "hint:" in text


def test_a_batch_waits_until_every_op_in_it_is_matched() -> None:
    # Rank 0's batch {0SEND_F0, 0RECV_B1}: the send is matched at once, the receive never,
    # because 1SEND_B1 comes after 1RECV_F1, which waits for 0SEND_F1 after the batch.
    schedule = plan(
        "0F0 0F1 0SEND_F0 0RECV_B1 0B1 0SEND_F1 0RECV_B0 0B0",
        "1RECV_F0 1F0 1RECV_F1 1F1 1B1 1SEND_B1 1B0 1SEND_B0",
    )
    text = rejected(schedule, 2, 2)
    assert "0RECV_B1 waits for 1SEND_B1" in text and "0SEND_F0 waits" not in text
    assert ">0SEND_F0< >0RECV_B1<" in text


def test_rejects_an_action_on_the_wrong_rank() -> None:
    text = rejected(plan("0F0 1F0 0B0", "1B0"), 2, 1)
    assert "wrong rank: 1F0 is on rank 0, but stage 1 runs on rank 1" in text
    assert ">1F0<" in text


def test_rejects_a_microbatch_out_of_range() -> None:
    text = rejected(plan("0F0 0B0 0F5 0B5"), 1, 1)
    assert "unexpected 0F5 on rank 0: microbatch 5 is out of range 0..0" in text


def test_rejects_a_comm_to_a_stage_that_does_not_exist() -> None:
    schedule = lower_comms(gpipe(2, 1))
    schedule[0].insert(0, Action.parse("0RECV_F0"))
    text = rejected(schedule, 2, 1)
    assert "unexpected 0RECV_F0" in text and "no neighbour stage -1" in text


def test_rejects_more_ranks_than_stages() -> None:
    text = rejected({**gpipe(2, 1), 2: [Action.parse("2F0")]}, 2, 1)
    assert "rank 2 has actions but there are only 2 stages" in text


@given(st.data())
def test_shuffled_rank_orders_are_accepted_only_if_they_simulate(data: st.DataObject) -> None:
    stages = data.draw(st.integers(1, 4))
    microbatches = data.draw(st.integers(1, 4))
    schedule = {
        r: data.draw(st.permutations(actions))
        for r, actions in lower_comms(gpipe(stages, microbatches)).items()
    }
    try:
        validate(schedule, stages, microbatches)
    except ScheduleError as e:
        assert e.grid
    else:
        # Accepted: it runs, and every compute follows what it consumes on its rank.
        simulate(schedule)
        for actions in schedule.values():
            for i, a in enumerate(actions):
                if a.kind is ActionKind.B:
                    assert Action(a.stage, ActionKind.F, a.microbatch) in actions[:i]


# ---------------------------------------------------------------- grid


def test_timeline_grid_shows_idle_steps_as_dots() -> None:
    assert format_grid(simulate(gpipe(2, 2))).splitlines() == [
        "t       0     1     2     3     4     5",
        "rank 0  0F0   0F1   .     .     0B0   0B1",
        "rank 1  .     1F0   1F1   1B0   1B1   .",
    ]


def test_timeline_grid_continues_a_long_action_with_tildes() -> None:
    grid = format_grid(simulate(gpipe(1, 1), backward_cost=2))
    assert grid.splitlines()[1].split() == ["rank", "0", "0F0", "0B0", "~"]


def test_grid_wraps_wide_schedules_into_blocks() -> None:
    grid = format_grid(lower_comms(one_f_one_b(4, 8)), width=80)
    assert max(len(line) for line in grid.splitlines()) <= 80
    assert grid.count("rank 3") > 1


def test_empty_timeline_has_no_bubble() -> None:
    assert bubble_fraction(Timeline({}, 0)) == 0.0


def test_docstring_examples_run() -> None:
    for module in (schedule_module, schedule_sim):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


# ---------------------------------------------------------------- several stages per rank

TWO_PER_RANK = (0, 1, 0, 1)  # four stages on two pp ranks: stage s on rank s % 2


def test_lowering_sends_each_transfer_to_its_peer_stage_on_another_rank() -> None:
    compute = plan("0F0 2F0 2B0 0B0", "1F0 3F0 3B0 1B0")
    assert lower_comms(compute, TWO_PER_RANK) == plan(
        "0F0 0SEND_F0 2RECV_F0 2F0 2SEND_F0 2RECV_B0 2B0 2SEND_B0 0RECV_B0 0B0",
        "1RECV_F0 1F0 1SEND_F0 3RECV_F0 3F0 3B0 3SEND_B0 1RECV_B0 1B0 1SEND_B0",
    )
    assert peer_rank(Action.parse("2SEND_F0"), TWO_PER_RANK) == 1
    assert peer_rank(Action.parse("1SEND_F0"), TWO_PER_RANK) == 0


def test_a_hand_written_two_stages_per_rank_schedule_validates_and_simulates() -> None:
    compute = plan(
        "0F0 0F1 2F0 2F1 0F2 0F3 2F2 2F3 2B0 2B1 0B0 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3F1 1F2 1F3 3F2 3F3 3B0 3B1 1B0 1B1 3B2 3B3 1B2 1B3",
    )
    validate(compute, 4, 4, TWO_PER_RANK)
    validate(lower_comms(compute, TWO_PER_RANK), 4, 4, TWO_PER_RANK)
    timeline = simulate(lower_comms(compute, TWO_PER_RANK), stage_to_rank=TWO_PER_RANK)
    assert format_grid(timeline).splitlines()[1].split()[2:6] == ["0F0", "0F1", "2F0", "2F1"]
    assert timeline.makespan == 18 and bubble_fraction(timeline) == pytest.approx(2 / 18)
    # Each rank holds its two stages' microbatches: all four of each under this GPipe.
    assert peak_in_flight(compute) == {0: 8, 1: 8}
    assert stage_in_flight(compute, 4) == (4, 4, 4, 4)


def test_a_deadlocking_two_stages_per_rank_schedule_is_refused_with_the_grid() -> None:
    # Rank 0 waits for stage 2's input before it has run stage 0, which produces it.
    text = rejected_on(plan("2F0 0F0 2B0 0B0", "1F0 3F0 3B0 1B0"), 4, 1, TWO_PER_RANK)
    assert "deadlock" in text and "2F0 needs 1F0 from rank 1, which has not run" in text
    assert ">2F0<" in text and ">1F0<" in text
    # Runs with free transfers, but not once lowered: rank 0 blocks sending 2F0's output
    # to 3F0 while rank 1 blocks sending 1F1's output to 2F1, each before its receive.
    compute = plan(
        "0F0 0F1 0F2 2F0 0F3 2F1 2F2 2F3 2B0 2B1 0B0 2B2 0B1 2B3 0B2 0B3",
        "1F0 1F1 1F2 3F0 1F3 3F1 3F2 3F3 3B0 3B1 1B0 3B2 1B1 3B3 1B2 1B3",
    )
    simulate(compute, stage_to_rank=TWO_PER_RANK)
    text = rejected_on(compute, 4, 4, TWO_PER_RANK)
    assert "after lower_comms: deadlock: no rank can proceed" in text
    assert "2SEND_F0 waits for 3RECV_F0 (rank 1, step 9), but rank 1 is stuck at step 5" in text
    assert ">2SEND_F0<" in text and ">1SEND_F1<" in text


def test_a_channel_carries_every_stage_pair_between_two_ranks_in_order() -> None:
    # Channel 1→0 carries stage 1's activation (for stage 2) and stage 1's gradient
    # (for stage 0); rank 0 takes the gradient first.
    lowered = plan(
        "0F0 0SEND_F0 0RECV_B0 2RECV_F0 2F0 2SEND_F0 2RECV_B0 2B0 2SEND_B0 0B0",
        "1RECV_F0 1F0 1SEND_F0 3RECV_F0 3F0 3B0 3SEND_B0 1RECV_B0 1B0 1SEND_B0",
    )
    text = rejected_on(lowered, 4, 1, TWO_PER_RANK)
    assert "mismatched transfer on channel 1→0: send #0 is 1SEND_F0 but receive #0 is" in text


def test_an_action_on_the_wrong_rank_names_the_stage_map() -> None:
    text = rejected_on(plan("0F0 1F0 2F0", "3F0"), 4, 1, TWO_PER_RANK)
    assert "wrong rank: 1F0 is on rank 0, but stage 1 runs on rank 1" in text
    assert "stage_to_rank [0, 1, 0, 1]" in text


@pytest.mark.parametrize(
    "stage_to_rank, words",
    [
        ((0, 1, 0), "names 3 stages"),
        ((0, 2, 0, 2), "must use every pp rank 0..2"),
        ((0, 0, 1, 1), "stages 0 and 1 both run on rank 0"),
    ],
)
def test_a_bad_stage_map_is_refused(stage_to_rank: tuple[int, ...], words: str) -> None:
    with pytest.raises(ScheduleError, match=words):
        generate(ScheduleKind.GPIPE, 4, 2, stage_to_rank)


@pytest.mark.parametrize("kind", MERGED)
@pytest.mark.parametrize("microbatches", [1, 2])
def test_generated_schedules_for_four_stages_on_two_ranks_validate(
    kind: ScheduleKind, microbatches: int
) -> None:
    compute = generate(kind, 4, microbatches, TWO_PER_RANK)
    assert {a.stage for a in compute[0]} == {0, 2} and {a.stage for a in compute[1]} == {1, 3}
    validate(compute, 4, microbatches, TWO_PER_RANK)
    validate(lower_comms(compute, TWO_PER_RANK), 4, microbatches, TWO_PER_RANK)
    # Each stage keeps its own generator's order: only the ranks' merge is new.
    per_stage = generate(kind, 4, microbatches)
    for s in range(4):
        assert [a for a in compute[s % 2] if a.stage == s] == per_stage[s]


def test_generated_gpipe_merges_each_ranks_stages_by_start_time() -> None:
    assert generate(ScheduleKind.GPIPE, 4, 2, TWO_PER_RANK) == plan(
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1", "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1"
    )


@pytest.mark.parametrize("kind", MERGED)
@pytest.mark.parametrize("pp, per_rank", [(2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("microbatches", range(1, 9))
def test_a_generated_virtual_schedule_validates_or_says_it_cannot_run(
    kind: ScheduleKind, pp: int, per_rank: int, microbatches: int
) -> None:
    stages = pp * per_rank
    stage_to_rank = tuple(s % pp for s in range(stages))
    try:
        compute = generate(kind, stages, microbatches, stage_to_rank)
    except ScheduleError as e:
        assert f"cannot run at {microbatches} microbatches with each rank's stages merged" in (
            e.message
        )
        assert "lower_comms" not in e.message  # parc's own words, not the user's
        assert e.grid and "parc.compile(schedule=...)" in str(e)
    else:
        validate(lower_comms(compute, stage_to_rank), stages, microbatches, stage_to_rank)


def test_schedule_actions_and_grid_docstring_examples_run() -> None:
    for module in (schedule_actions, schedule_grid, schedule_split):
        result = doctest.testmod(module)
        assert result.failed == 0, module.__name__
    assert doctest.testmod(schedule_actions).attempted > 0
    assert doctest.testmod(schedule_split).attempted > 0


def test_a_virtual_schedule_that_cannot_run_is_named_at_its_spec_line() -> None:
    # Was the schedule's internal words ("after lower_comms: ...") with no spec line
    # (found by a probe), then the simulator's grid: now the `virtual_stages` line, what
    # 1f1b runs there and the fix (tests/test_stage_lines_probe.py).
    from helpers import MLP

    from parc.compiler.frontend import analyse
    from parc.errors import PlanError

    spec = "mesh pp=2\nstage auto\nvirtual_stages 2\nmicrobatches 8\n"
    with pytest.raises(PlanError) as caught:
        analyse(spec, MLP, batch=8)
    text = str(caught.value)
    assert text.startswith("<spec>:3:1: error: the default `1f1b` is a schedule for one stage")
    assert "runs at most 2 microbatches, and the spec has 8" in text
    assert "    virtual_stages 2\n    ^" in text and "schedule interleaved" in text
    assert "step " not in text  # refused before the simulator, without its grid
