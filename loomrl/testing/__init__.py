"""Code the tests use that the library's run never calls (it imports the library, never the other way)."""
