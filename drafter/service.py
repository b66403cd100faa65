"""gRPC servicer of the drafter: converts messages and maps errors, and holds no session state.

Everything about a session lives in Redis, so any replica serves any call; what a call may
carry is checked by the protobuf-free core (drafter/core.py).
"""

from __future__ import annotations

import time

import grpc

from pardec.drafter.config import DrafterConfig
from pardec.drafter.core import Drafter, draft_params
from pardec.runtime.parsing import add_servicer
from pardec.runtime.serving import maps_errors
from pardec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, config: DrafterConfig):
        self.drafter = Drafter(config)

    def add_to(self, server: grpc.Server) -> None:
        add_servicer(server, self, drafter_pb2.DESCRIPTOR.services_by_name["Drafter"])

    @maps_errors
    def StartSession(self, request, context):
        start = time.perf_counter()
        config = request.config
        settings = draft_params(**{field.name: getattr(config, field.name) for field in config.DESCRIPTOR.fields})
        self.drafter.start_session(
            request.session_id, request.prompt_token_ids, settings, request.client_session_id, request.shared_memory
        )
        return drafter_pb2.StartSessionResponse(drafter_ms=(time.perf_counter() - start) * 1e3)

    @maps_errors
    def Propose(self, request, context):
        start = time.perf_counter()
        tokens, parents, probabilities = self.drafter.propose(
            request.session_id,
            request.new_token_ids,
            request.last_node_argmax,
            request.max_nodes,
            request.max_depth,
            request.verified_depth if request.HasField("verified_depth") else -1,
            request.committed_length if request.HasField("committed_length") else -1,
        )
        return drafter_pb2.ProposeResponse(
            tree=common_pb2.TokenTree(token_ids=tokens, parents=parents),
            drafter_ms=(time.perf_counter() - start) * 1e3,
            accept_probabilities=probabilities,
        )

    @maps_errors
    def EndSession(self, request, context):
        self.drafter.end_session(request.session_id, request.new_token_ids)
        return drafter_pb2.EndSessionResponse()
