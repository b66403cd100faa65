"""pardec verifier."""
