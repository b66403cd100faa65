"""The runtime every pardec service shares: gRPC serving and security, parsing of addresses and
flags, metrics, the error type that maps to gRPC status codes, and the health probe."""
