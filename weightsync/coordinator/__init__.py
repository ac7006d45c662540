"""The control plane: the gRPC contract, the coordinator (server and core) and the client.

Trainers and replica agents register with what they can send or receive and hold
a lease; the publisher opens each version and gets a channel plan per replica
(``negotiation``); replicas watch for plans, report ready and ack; a version is
READY when the job's ack policy is met (``lifecycle``), FAILED on timeout or when
the trainer is lost, SUPERSEDED once a newer one is READY. READY state survives a
restart through a ``store.VersionStore``.

Public surface (import the modules, not the names):

- ``weightsync.coordinator.client.CoordinatorClient`` - what the publisher and the agent use;
- ``weightsync.coordinator.models`` - the typed domain objects it takes and returns;
- ``weightsync.coordinator.server.CoordinatorServer`` / ``ServerConfig`` - embedding a coordinator;
- ``weightsync.coordinator.faults`` - the errors, one per gRPC status code.

The generated protobuf code (``_proto``) never leaves this package: ``serde``
converts at the edge, and nothing outside imports it (the channels must not).
Importing this package imports nothing heavy; ``client`` and ``server`` import grpc.
"""
