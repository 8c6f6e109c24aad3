"""Statistics (diffusers_trtllm.stats) at their edges, on a run of planned calls whose counters are filled by hand:
what a step keeps, counted and uncounted backends in one layer, the probe's relative error (exact zero outputs
included) and the tables, without running a model."""

import math

import pytest
import torch

from diffusers_trtllm.config import AccuracySpec, AttnQuantSpec, SkipSoftmaxSpec
from diffusers_trtllm.plan import AttentionCall, CallSite
from diffusers_trtllm.run_state import Run
from diffusers_trtllm.stats import AttentionStats, CallRecord, relative_error


def planned_call(layer: str, *, skip: float | None = None, quant: AttnQuantSpec | None = None,
                 accuracy: AccuracySpec | None = None, backend: str = "TORCH_REFERENCE") -> AttentionCall:
    skip_spec = None if skip is None else SkipSoftmaxSpec(threshold=skip)
    return AttentionCall(CallSite("transformer", layer, "self", "self"), backend, False, quant, skip_spec,
                         accuracy=accuracy, counting=True)


class HandRun:
    """A run of ``calls`` with its statistics, whose counters the test fills as the op would."""

    def __init__(self, *calls: AttentionCall):
        self.calls = calls
        self.run = Run.start(1, calls, torch.device("cpu"), counting=True)
        self.stats = AttentionStats(self.run)
        self.plan(0)

    def plan(self, step: int) -> None:
        for i, call in enumerate(self.calls):
            row, self.run.step_probed[i] = call.plan_row(None, step, self.run.guard_dropped[i])
            self.run.settings[i] = torch.tensor(row, dtype=torch.float64)

    def add(self, call: AttentionCall, skipped: int, total: int, counted: bool = True, times: int = 1) -> None:
        for _ in range(times):  # what the op adds per call: skipped tiles, tiles, one call, whether it counted
            self.run.count_call(self.calls.index(call), *((skipped, total) if counted else ()))

    def add_errors(self, call: AttentionCall, sums) -> None:
        self.run.error_sums[self.calls.index(call)] += torch.tensor(sums, dtype=torch.float64)


@pytest.mark.parametrize("error_sq,exact_sq,error", [(0.0, 0.0, 0.0), (1.0, 0.0, math.inf), (1.0, 4.0, 0.5)])
def test_relative_error_of_an_exact_zero_output(error_sq, exact_sq, error):
    assert relative_error(error_sq, exact_sq) == error


def test_a_step_keeps_every_call_of_a_layer_and_zeroes_the_counters():
    skipping, dense, idle = planned_call("a", skip=0.5), planned_call("b"), planned_call("c")
    hand = HandRun(skipping, dense, idle)  # idle makes no call: no record
    stats, add = hand.stats, hand.add
    add(skipping, 1, 4, times=2)
    add(dense, 0, 4)
    stats.close_step(0)
    assert [hand.run.counts_of(i) for i in range(3)] == [[0, 0, 0, 0]] * 3
    stats.close_step(0)  # nothing counted since: nothing kept
    add(skipping, 4, 4)
    stats.close_step(1)
    assert stats.records == {
        (0, "transformer.a", "TORCH_REFERENCE", "skip"): CallRecord("TORCH_REFERENCE", "skip", 2, 2, 8),
        (0, "transformer.b", "TORCH_REFERENCE", "dense"): CallRecord("TORCH_REFERENCE", "dense", 1, 0, 4),
        (1, "transformer.a", "TORCH_REFERENCE", "skip"): CallRecord("TORCH_REFERENCE", "skip", 1, 4, 4)}
    # sparsity is over the calls that ran Skip-Softmax: the dense layer b is not averaged in
    assert stats.per_step() == {0: 2 / 8, 1: 1.0}
    assert stats.per_layer() == {"transformer.a": 6 / 12, "transformer.b": None}
    assert stats.modes() == {0: {"TORCH_REFERENCE:skip": 1, "TORCH_REFERENCE:dense": 1},
                             1: {"TORCH_REFERENCE:skip": 1}}
    assert stats.summary() == {"sparsity": 6 / 12, "reused": 0.0, "per_step": stats.per_step(), "per_layer": stats.per_layer(),
                               "modes": stats.modes(), "error": None, "error_per_step": {}, "error_per_layer": {}}
    assert stats.table() == "\n".join([
        "| step | modes | sparsity | probed error | worst layer (error) |", "|---:|---|---:|---:|---|",
        "| 0 | 1× TORCH_REFERENCE:dense, 1× TORCH_REFERENCE:skip | 0.250 | - | - |",
        "| 1 | 1× TORCH_REFERENCE:skip | 1.000 | - | - |"])
    assert AttentionStats(Run.start(2, (skipping,), torch.device("cpu"), counting=True)).summary()["sparsity"] is None


def test_a_backend_that_does_not_count_gives_no_sparsity_but_leaves_the_counted_ones():
    counted, uncounted = planned_call("a", skip=0.5), planned_call("b", skip=0.5, backend="OTHER")
    mixed_counted, mixed_uncounted = planned_call("m", skip=0.5), planned_call("m", skip=0.5, backend="OTHER")
    hand = HandRun(counted, uncounted, mixed_counted, mixed_uncounted)
    stats, add = hand.stats, hand.add
    add(counted, 1, 4)
    add(uncounted, 0, 0, counted=False)
    add(mixed_counted, 3, 4)
    add(mixed_uncounted, 0, 0, counted=False)
    stats.close_step(0)
    add(uncounted, 0, 0, counted=False)
    add(uncounted, 2, 4)  # one call of the step counted, one did not: the step's record is not counted
    stats.close_step(1)
    records = stats.records
    assert records[(0, "transformer.b", "OTHER", "skip")].sparsity is None
    assert records[(1, "transformer.b", "OTHER", "skip")].counted is False
    assert stats.per_layer() == {"transformer.a": 0.25, "transformer.b": None, "transformer.m": 0.75}
    assert stats.per_step() == {0: 0.5, 1: None}
    assert [row.split(" | ")[2] for row in stats.table().splitlines()[2:]] == ["0.500", "n/a"]  # skipped, uncounted
    assert stats.summary()["sparsity"] == 4 / 8
    assert CallRecord("X", "skip", total=0).sparsity == 0.0


def test_a_counted_layer_without_tiles_has_sparsity_0():
    call = planned_call("a", skip=0.5)
    hand = HandRun(call)
    stats = hand.stats
    hand.add(call, 0, 0)
    stats.close_step(0)
    assert stats.per_layer() == {"transformer.a": 0.0} and stats.per_step() == {0: 0.0}


def test_the_probes_error_is_pooled_over_probed_steps_and_layers_only():
    probe = AccuracySpec(probe_rows=4, probe_every=2)
    a, b = planned_call("a", quant=AttnQuantSpec("int8"), accuracy=probe), planned_call("b", accuracy=probe)
    unprobed = planned_call("c")
    hand = HandRun(a, unprobed, b)
    stats = hand.stats
    for step, (a_sums, b_sums) in enumerate([((1.0, 4.0), (9.0, 4.0)), ((5.0, 5.0), (5.0, 5.0)),
                                              ((0.0, 16.0), (0.0, 0.0))]):
        hand.plan(step)
        for call in (a, b, unprobed):
            hand.add(call, 0, 4)
        hand.add_errors(a, a_sums)
        hand.add_errors(b, b_sums)
        stats.close_step(step)
        if step == 0:
            assert stats.step_errors(0) == {0: (1.0, 4.0), 2: (9.0, 4.0)}
            assert stats.step_errors(1) == {}  # not the last closed step
    assert hand.run.error_sums.tolist() == [[0.0, 0.0]] * 3
    records = stats.records
    assert records[(1, "transformer.a", "TORCH_REFERENCE", "sage-int8")].error is None  # step 1 is not probed
    assert records[(0, "transformer.c", "TORCH_REFERENCE", "dense")].error is None
    assert stats.errors() == {(0, "transformer.a"): 0.5, (0, "transformer.b"): 1.5, (2, "transformer.a"): 0.0,
                              (2, "transformer.b"): 0.0}
    assert stats.error_per_step() == {0: math.sqrt(10 / 8), 2: 0.0}
    assert stats.error_per_layer() == {"transformer.a": math.sqrt(1 / 20), "transformer.b": 1.5}
    assert stats.summary()["error"] == math.sqrt(10 / 24)
    assert stats.table().splitlines()[2:] == [
        f"| 0 | 2× TORCH_REFERENCE:dense, 1× TORCH_REFERENCE:sage-int8 | off | {math.sqrt(10 / 8):.2e} | "
        "transformer.b (1.50e+00) |",
        "| 1 | 2× TORCH_REFERENCE:dense, 1× TORCH_REFERENCE:sage-int8 | off | - | - |",
        "| 2 | 2× TORCH_REFERENCE:dense, 1× TORCH_REFERENCE:sage-int8 | off | 0.00e+00 | "
        "transformer.a (0.00e+00) |"]
    assert stats.error_table() == "\n".join([
        "| layer | ran (probed steps) | probed error | worst step (error) | sparsity |", "|---|---|---:|---:|---:|",
        f"| transformer.a | TORCH_REFERENCE:sage-int8 | {math.sqrt(1 / 20):.2e} | 0 (5.00e-01) | off |",
        "| transformer.b | TORCH_REFERENCE:dense | 1.50e+00 | 0 (1.50e+00) | off |"])


def test_statistics_without_a_probed_call_have_no_error():
    call = planned_call("a")
    hand = HandRun(call)
    stats = hand.stats
    hand.add(call, 0, 4)
    stats.close_step(0)
    assert stats.step_errors(0) == {} and stats.summary()["error"] is None and stats.error_table() == ""
    assert AttentionStats().summary()["sparsity"] is None


def test_tables_say_off_where_no_layer_skipped_and_list_every_mode_a_probed_layer_ran():
    """A layer whose backend does not count tiles, probed at two steps, with SAGE taken away by the guard after the
    first."""
    call = planned_call("a", quant=AttnQuantSpec("int8"), accuracy=AccuracySpec(), backend="OTHER")
    hand = HandRun(call)
    stats = hand.stats
    for step in range(2):
        if step:
            hand.run.guard_dropped[0].add("sage")
        hand.plan(step)
        hand.add(call, 0, 0, counted=False)
        hand.add_errors(call, [1.0, 4.0])
        stats.close_step(step)
    assert stats.table().splitlines()[2:] == [
        "| 0 | 1× OTHER:sage-int8 | off | 5.00e-01 | transformer.a (5.00e-01) |",
        "| 1 | 1× OTHER:dense | off | 5.00e-01 | transformer.a (5.00e-01) |"]
    assert stats.error_table().splitlines()[2:] == [
        "| transformer.a | OTHER:dense, OTHER:sage-int8 | 5.00e-01 | 0 (5.00e-01) | off |"]
