"""Process-level helpers: logging, SIGTERM handling, and fault injection for the crash tests."""
