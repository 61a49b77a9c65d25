"""The syncer process and its parts.

State and rules (no device code), the gRPC service, write-ahead log and snapshots, and
`python -m decoupled_diloco.syncer`.
"""
