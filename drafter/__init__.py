"""pardec drafter."""
