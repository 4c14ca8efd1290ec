"""Reliability and security: hostile input, repository confinement, auth, overload, fuzzing."""
