"""The protocol between the runtime and the agent: the one part of the agent that workers import.

``telemetry.proto`` and the code generated from it (``telemetry_pb2*``: regenerate with grpc_tools.protoc, see
tests/unit/test_proto_generated.py) are the wire format of the worker's stream; ``contract`` holds every other
fact both sides use (environment variable names, exit codes, checkpoint stage names, the job-name rule, the
diagnostics file names); ``atomic_file`` is how either side writes a file the other reads, ``regular_file`` how
either reads a file in a tree another user writes (no link, no FIFO, bounded), and ``metadata_unpickler`` how a
checkpoint's DCP metadata is unpickled without running what it names (an allow-list). This package
imports nothing else of trainwarden: it is the leaf of the import graph.
"""
