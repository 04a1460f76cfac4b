"""The request path's narrow interface to the flows (router/dataplane/path_control.py) over a real Admission and
LiveRequests."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.core.config import AdmissionConfig
from router.core.registry import Registry, Role, Worker
from router.core.traffic import AbortAction, RequestPathControl
from router.dataplane.admission import Admission
from router.dataplane.live import LiveRequests
from router.dataplane.path_control import DataplaneControl


@dataclass(eq=False)
class Request:
    """What LiveRequests keeps of an attempt: its pair, its rids, and the mark the flows set."""

    prefill: Worker
    decode: Worker
    rids: list[str] = field(default_factory=list)
    abort_action: AbortAction | None = None


def setup() -> tuple[DataplaneControl, Admission, LiveRequests, list[Worker]]:
    registry = Registry()
    workers = [registry.add("http://p1:1", Role.PREFILL, 8998), registry.add("http://p2:1", Role.PREFILL, 8998),
               registry.add("http://d1:1", Role.DECODE, None)]
    admission, live = Admission(AdmissionConfig()), LiveRequests()
    return DataplaneControl(admission, live), admission, live, workers


def test_it_has_everything_the_flows_ask_for():
    control, *_ = setup()
    wanted = {name for name in dir(RequestPathControl) if not name.startswith("_")}
    assert wanted <= set(dir(control))


def test_hold_and_release_close_and_open_admission_per_reason():
    control, admission, _, _ = setup()
    control.close_gate("update op1")
    control.close_gate("pause_generation")
    control.open_gate("update op1")
    assert not admission.is_open and control.admission_state()["holds"] == ["pause_generation"]
    control.open_gate("pause_generation")
    assert admission.is_open and control.admission_state()["open"] is True
    assert control.held_total == admission.held_total == 0


def test_marks_requests_on_workers_and_an_answer_is_never_turned_into_a_retry():
    control, _, live, (p1, p2, d1) = setup()
    on_p1, on_p2 = Request(p1, d1, ["a"]), Request(p2, d1, ["b"])
    live.add(on_p1)
    live.add(on_p2)
    assert control.count_on([p1]) == 1 and control.count_on([d1]) == 2
    assert control.mark_on([p1], AbortAction.ANSWER) == 1
    assert on_p1.abort_action is AbortAction.ANSWER and on_p2.abort_action is None
    assert control.mark_on([d1], AbortAction.RETRY) == 2
    assert on_p1.abort_action is AbortAction.ANSWER and on_p2.abort_action is AbortAction.RETRY


def test_mark_rid_marks_that_request_and_names_its_sequences():
    control, _, live, (p1, _, d1) = setup()
    batch, other = Request(p1, d1, ["r", "r_0", "r_1"]), Request(p1, d1, ["s"])
    live.add(batch)
    live.add(other)
    request, rids = control.mark_rid("r", AbortAction.ANSWER)
    assert request is batch and rids == ["r", "r_0", "r_1"]
    assert batch.abort_action is AbortAction.ANSWER and other.abort_action is None
    assert control.mark_rid("unknown", AbortAction.ANSWER) is None


def test_mark_all_returns_every_live_request_and_still_live_drops_the_ended_ones():
    control, _, live, (p1, p2, d1) = setup()
    first, second = Request(p1, d1, ["a"]), Request(p2, d1, ["b"])
    live.add(first)
    live.add(second)
    marked = control.mark_all(AbortAction.ANSWER)
    assert set(marked) == {first, second} and all(r.abort_action is AbortAction.ANSWER for r in marked)
    live.discard(first)
    assert control.still_live(marked) == [second]


def test_abort_sends_each_requests_rids_to_both_of_its_servers():
    registry = Registry()
    p, d = registry.add("http://p1:1", Role.PREFILL, 8998), registry.add("http://d1:1", Role.DECODE, None)
    sent: list[tuple[str, list[str]]] = []
    control = DataplaneControl(Admission(AdmissionConfig()), LiveRequests(),
                               abort_on=lambda worker, rids: sent.append((worker.url, rids)))
    control.abort([Request(p, d, ["a", "a_0"]), Request(p, d, [])])  # no rid: nothing to abort it by
    assert sent == [(p.url, ["a", "a_0"]), (d.url, ["a", "a_0"])]
