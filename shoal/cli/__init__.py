"""The ``shoal`` command line."""

from shoal.omp import apply_defaults

apply_defaults()  # before any subcommand imports torch
