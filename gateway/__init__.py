"""pardec gateway."""
