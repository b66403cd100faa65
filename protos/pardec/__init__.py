"""pardec: parallel-decoding LLM inference over gRPC. This package holds the wire contract."""
