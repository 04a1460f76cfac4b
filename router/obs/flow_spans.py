"""Spans of the fleet's long operations: one per role conversion or fleet operation (weight update, pause,
continue, memory release/resume), with a child span per step, timed as the flow's own step records are
(`flows/steps.py`), so an operator sees which step an update waited in (hold, quiesce, update, verify, ...).

Made from the finished record, through the flows' observers (the flows know nothing of tracing): each span is
exported when its operation ends, with the start and end the flow recorded. Each operation is a trace of its
own (an operator's call is not a generation request).
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

_MAX_TEXT = 500


def _ns(wall_s: float) -> int:
    return int(wall_s * 1e9)


def _scalar(value):
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)[:_MAX_TEXT]


class FlowSpans:
    def __init__(self, tracer) -> None:
        self._tracer = tracer

    def conversion_observer(self, event: str, conversion, details: dict) -> None:
        """A `Conversions` observer: the conversion's span when it has finished."""
        if event != "finished":
            return
        attributes = {"pd.conversion.id": conversion.id, "pd.worker_id": conversion.worker_id,
                      "server.url": conversion.worker_url, "pd.old_role": str(conversion.old_role),
                      "pd.new_role": str(conversion.new_role), "pd.drain_mode": str(conversion.mode),
                      "pd.outcome": str(conversion.outcome), "pd.status": conversion.status,
                      "pd.message": conversion.message[:_MAX_TEXT]}
        if conversion.api:
            attributes["pd.switch_api"] = conversion.api
        ok = str(conversion.outcome) == "converted"
        self._emit(f"convert {conversion.old_role} -> {conversion.new_role}", conversion.started_at,
                   conversion.duration_s, attributes, conversion.steps, ok, conversion.message)

    def operation_observer(self, op) -> None:
        """An `OperationRunner` observer: a finished fleet operation's span."""
        attributes = {"pd.operation.id": op.id, "pd.operation.kind": op.kind, "pd.state": op.state,
                      "pd.status": op.status, "pd.message": op.message[:_MAX_TEXT],
                      "pd.aborted_requests": op.aborted_requests, "pd.held_requests": op.held_requests}
        for name in ("hold_s", "quiesce_s", "weight_version", "lost"):
            if (value := getattr(op, name)) is not None:
                attributes[f"pd.{name}"] = _scalar(value)
        for key, value in op.options.items():
            if not isinstance(value, (dict, list)):  # the update's options (model path, abort, version)
                attributes[f"pd.option.{key}"] = _scalar(value)
        self._emit(op.kind.replace("_", " "), op.started_at, op.duration_s, attributes, op.steps,
                   op.state == "succeeded", op.message)

    def _emit(self, name: str, started_at: float, duration_s: float | None, attributes: dict, steps, ok: bool,
              message: str) -> None:
        start = _ns(started_at)
        end = _ns(started_at + (duration_s or 0.0))
        parent = self._tracer.start_span(name, kind=SpanKind.INTERNAL, start_time=start, attributes=attributes,
                                         context=trace.set_span_in_context(trace.INVALID_SPAN))
        if not ok:
            parent.set_status(Status(StatusCode.ERROR, message[:_MAX_TEXT]))
        context = trace.set_span_in_context(parent)
        for step in steps:
            step_start = _ns(step.started_at)
            step_end = step_start + _ns(step.duration_s or 0.0)
            attrs = {"pd.step.outcome": step.outcome, "pd.step.attempts": step.attempts}
            if step.deadline_s is not None:
                attrs["pd.step.deadline_s"] = step.deadline_s
            if step.message:
                attrs["pd.step.message"] = step.message[:_MAX_TEXT]
            for key, value in step.details.items():
                attrs[f"pd.step.{key}"] = _scalar(value)
            span = self._tracer.start_span(step.name, context=context, start_time=step_start, attributes=attrs)
            if step.outcome not in ("ok", "skipped"):
                span.set_status(Status(StatusCode.ERROR, step.message[:_MAX_TEXT]))
            span.end(end_time=max(step_end, step_start))
        parent.end(end_time=max(end, start))
