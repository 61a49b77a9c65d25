"""How a `SyncerService`'s handlers are served: every request an unparsed stream of bytes.

`add_service` registers the handlers with a gRPC server. Mirroring the generated
`add_SyncerServicer_to_server`, except that each request arrives unparsed (on the wire a unary
request is the same), so the caller's secret is checked from the metadata before a byte of the
body is read; the control calls (Register, Heartbeat, Status, Lease) go through `control_call`,
which reads their one message under the service's control guard, and Pull replies may be
pre-encoded bytes (`wire.data_chunk`), which saves two copies per chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from decoupled_diloco.syncer.guard import Guard

Handler = Callable[..., Any]


class Served(Protocol):
    """What the handlers need of a service (`service.SyncerService` is one)."""

    control: Guard  # admits the control calls: slots per caller, idle cuts

    def authorize(self, context: grpc.ServicerContext) -> int:
        """The caller's identity from the call's metadata; aborts the call if it has none."""

    Register: Handler  # (identity, raw request or None, context) -> reply
    Heartbeat: Handler
    Status: Handler
    Lease: Handler
    Push: Handler  # (request iterator of raw bytes, context) -> reply
    Pull: Handler  # (request iterator, context) -> iterator of replies or raw bytes


def control_call(service: Served, method: Callable[..., Any]) -> Callable[..., Any]:
    """A unary call served as a stream: the secret is checked before the body is read.

    gRPC would otherwise read a unary request's body on the worker thread before any
    handler code runs, so that a caller without a secret could hold threads by never
    sending it. The body is read under the control calls' guard (slots, idle cut).

    Args:
      service: the service whose `authorize` and `control` guard admit the call.
      method: its handler, called with (identity, the raw request or None, context).
    """

    def handler(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        identity = service.authorize(context)
        with service.control.call(identity, context, method.__name__) as activity:
            try:
                raw = next(request_iterator, None)
            except grpc.RpcError:
                if activity.idle_cut:  # cancelled: the client gets CANCELLED
                    return b""
                raise
            activity.hold()
            return method(identity, raw, context)

    return handler


def _serialize(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_service(service: Served, server: grpc.Server) -> None:
    """Registers the handlers; the data calls take and give raw bytes (see `wire.data_chunk`).

    Mirrors the generated `add_SyncerServicer_to_server`, except that every request arrives as
    an unparsed stream (the handler checks the caller's secret from the metadata before it reads
    a byte of the body; on the wire a unary request is the same) and Pull responses may be
    pre-encoded bytes, which saves two copies per chunk.
    """
    control = {
        "Register": service.Register,
        "Heartbeat": service.Heartbeat,
        "Status": service.Status,
        "Lease": service.Lease,
    }
    handlers = {
        name: grpc.stream_unary_rpc_method_handler(control_call(service, method), None, _serialize)
        for name, method in control.items()
    }
    handlers.update(
        {
            "Push": grpc.stream_unary_rpc_method_handler(service.Push, None, _serialize),
            "Pull": grpc.stream_stream_rpc_method_handler(service.Pull, None, _serialize),
        }
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("decoupled_diloco.Syncer", handlers),)
    )
    server.add_registered_method_handlers("decoupled_diloco.Syncer", handlers)
