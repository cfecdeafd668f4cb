"""The ``shoal`` command line."""
