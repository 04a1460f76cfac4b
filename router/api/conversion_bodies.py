"""Bodies of the role-conversion endpoints, and the flow's `Plan` each one asks for.

Here a null field means "not given" (its default applies), for every field.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from router.api.bodies import (Body, Flag, JsonObject, NonNegativeNumber, Port, PositiveIntegers, PositiveNumber,
                               WorkerUrl, one_of)
from router.core.registry import Role
from router.flows.conversion_record import DrainMode, Plan
from router.flows.role_switch import CONVERT_PD_ROLE, ROUTER_SWITCH_FIELDS, SERVER_OPTIONS

# Enums are read from their JSON values (`strict=False` lets "drain" be DrainMode.DRAIN; nothing else passes).
DrainModeField = Annotated[DrainMode, Field(strict=False, description=one_of(m.value for m in DrainMode))]
RoleField = Annotated[Role, Field(strict=False, description=one_of(r.value for r in Role))]


class ConversionBody(Body):
    mode: DrainModeField = DrainMode.DRAIN
    server_options: JsonObject = None  # sent verbatim to whichever switch API the server has
    # The server options the router knows (SERVER_OPTIONS), given at the top level of the body.
    decode_cuda_graph_bs: PositiveIntegers = None
    decode_cuda_graph_memory_gb: NonNegativeNumber = None
    bootstrap_port: Port = None
    disable_radix_cache: Flag = None
    disable_cuda_graph: Flag = None

    @field_validator("server_options")
    @classmethod
    def _router_fields_are_the_routers(cls, options: dict | None) -> dict | None:
        owned = sorted(ROUTER_SWITCH_FIELDS.intersection(options or ()))
        if owned:
            raise ValueError(f"{', '.join(owned)} may not be given here: the router sets "
                             f"{'it' if len(owned) == 1 else 'them'} from the conversion's plan")
        return options

    @model_validator(mode="before")
    @classmethod
    def _null_means_not_given(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}  # null bogus: 400

    def _plan(self, *, new_role: Role | None, empty_timeout_s: float | None, switch_timeout_s: float | None,
              verify_timeout_s: float | None = None, api: str | None = None) -> Plan:
        return Plan(mode=self.mode, new_role=new_role, empty_timeout_s=empty_timeout_s,
                    switch_timeout_s=switch_timeout_s, verify_timeout_s=verify_timeout_s,
                    server_options={k: getattr(self, k) for k in SERVER_OPTIONS if k in self.model_fields_set},
                    raw_server_options=dict(self.server_options or {}), api=api)


assert SERVER_OPTIONS.keys() <= ConversionBody.model_fields.keys()


class ConvertPdRole(ConversionBody):
    """The seed design's `/convert_pd_role`: to the opposite role, through the server's own /convert_pd_role
    where it has one (it takes the design's options: bootstrap_port, disable_radix_cache, ...)."""

    server_url: WorkerUrl
    drain_timeout_secs: PositiveNumber = None
    switch_timeout_secs: PositiveNumber = None

    @property
    def url(self) -> str:
        return self.server_url

    def plan(self) -> Plan:
        return self._plan(new_role=None, empty_timeout_s=self.drain_timeout_secs,
                          switch_timeout_s=self.switch_timeout_secs, api=CONVERT_PD_ROLE)


class PdRoleSwitch(ConversionBody):
    """Upstream mini_lb's `/pd_role_switch`."""

    worker_url: WorkerUrl
    new_role: RoleField
    drain_timeout_secs: PositiveNumber = None
    switch_timeout_secs: PositiveNumber = None

    @property
    def url(self) -> str:
        return self.worker_url

    def plan(self) -> Plan:
        return self._plan(new_role=self.new_role, empty_timeout_s=self.drain_timeout_secs,
                          switch_timeout_s=self.switch_timeout_secs)


class ConvertWorker(ConversionBody):
    """`/admin/workers/{id}/convert`: the router's own, with every deadline and `wait`."""

    new_role: RoleField = None  # None: the opposite of the worker's role
    timeout_s: PositiveNumber = None
    switch_timeout_s: PositiveNumber = None
    verify_timeout_s: PositiveNumber = None
    wait: Flag = True  # false: answer 202 at once

    def plan(self) -> Plan:
        return self._plan(new_role=self.new_role, empty_timeout_s=self.timeout_s,
                          switch_timeout_s=self.switch_timeout_s, verify_timeout_s=self.verify_timeout_s)
