"""Bodies of SGLang's control endpoints as the router serves them for the fleet.

The fields are SGLang 0.5.23's (`io_struct.py`), forwarded to every server as the client sent them; a field
the client left out stays out, so each server applies its own default. The router adds `retry_aborted`
to the endpoints that abort requests, and reads `abort_all_requests` of `release_memory_occupation`
itself: `ROUTER_FIELDS` are never forwarded.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from router.api.bodies import (Body, Flag, Integer, OptionalJsonObject, OptionalText, OptionalTexts,
                               Text, Texts, one_of)
from router.flows.weight_updates import DISK, DISTRIBUTED, TENSOR, VERSION

PAUSE_MODES = ("abort", "retract", "in_place")
SELECTORS = ("target", "draft", "all")

PauseMode = Annotated[Literal[PAUSE_MODES], Field(description=one_of(PAUSE_MODES))]
Selector = Annotated[Literal[SELECTORS], Field(description=one_of(SELECTORS))]
Shapes = Annotated[list[list[int]], Field(description="a list of lists of integers")]
Base64Texts = Annotated[list[str], Field(description="a list of base64 strings")]


class ControlBody(Body):
    ROUTER_FIELDS: ClassVar[frozenset[str]] = frozenset()

    def forwarded(self) -> dict:
        """What every server gets: the client's fields but the router's own."""
        return self.given(exclude=self.ROUTER_FIELDS)


class Retryable(ControlBody):
    """An endpoint that may abort requests: `retry_aborted` says whether the router re-sends them."""

    ROUTER_FIELDS = frozenset({"retry_aborted"})
    retry_aborted: Flag = None

    def retry(self, default: bool) -> bool:
        return default if self.retry_aborted is None else self.retry_aborted


# ---- weight updates ----------------------------------------------------------------------------------------
class WeightUpdate(Retryable):
    abort_all_requests: Flag = False  # SGLang's default; the router aborts (and waits) itself when true
    weight_version: OptionalText = None
    load_format: OptionalText = None
    flush_cache: Flag = None
    torch_empty_cache: Flag = None


class UpdateFromDisk(WeightUpdate):
    model_path: Text
    is_async: Flag = None
    keep_pause: Flag = None
    recapture_cuda_graph: Flag = None
    token_step: Integer = None
    manifest: OptionalJsonObject = None


class UpdateFromDistributed(WeightUpdate):
    names: Texts
    dtypes: Texts
    shapes: Shapes
    group_name: Text = None
    selector: Selector = None


class UpdateFromTensor(WeightUpdate):
    serialized_named_tensors: Base64Texts
    selector: Selector = None


class UpdateVersion(Retryable):
    new_version: Text
    abort_all_requests: Flag = True  # SGLang's default for a relabel, unlike the other updates


UPDATE_BODIES: dict[str, type[WeightUpdate | UpdateVersion]] = {
    DISK: UpdateFromDisk, DISTRIBUTED: UpdateFromDistributed, TENSOR: UpdateFromTensor, VERSION: UpdateVersion,
}


class InitUpdateGroup(ControlBody):
    master_address: Text
    master_port: Integer
    rank_offset: Integer
    world_size: Integer
    group_name: Text = None
    backend: Text = None


class DestroyUpdateGroup(ControlBody):
    group_name: Text = None


class BeginUpdate(ControlBody):
    selector: Selector = None


BROADCAST_BODIES: dict[str, type[ControlBody]] = {
    "destroy_weights_update_group": DestroyUpdateGroup, "begin_weight_update": BeginUpdate,
    "end_weight_update": ControlBody,  # takes no field
}


# ---- generation and memory ---------------------------------------------------------------------------------
class AbortRequest(ControlBody):
    rid: Text = None  # one request (or the parent of its rid_N sequences); unknown ones go to every server
    abort_all: Flag = False


class PauseGeneration(Retryable):
    mode: PauseMode = None


class ContinueGeneration(ControlBody):
    torch_empty_cache: Flag = None


class ReleaseMemory(Retryable):
    ROUTER_FIELDS = frozenset({"retry_aborted", "abort_all_requests"})
    tags: OptionalTexts = None
    abort_all_requests: Flag = False  # the router's: abort (and wait for) everything in flight first


class ResumeMemory(ControlBody):
    tags: OptionalTexts = None
