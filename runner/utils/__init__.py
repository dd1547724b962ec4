"""Device and host plumbing the other runner packages share (the bottom of the import graph:
it imports no other runner package)."""
