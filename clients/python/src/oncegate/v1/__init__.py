"""The wire types of ``oncegate.v1``, generated at build time from the repository's proto
(``gate_pb2``, ``gate_pb2_grpc``, ``admin_pb2``, ``admin_pb2_grpc``); never edited by hand."""
