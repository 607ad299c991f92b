"""Subcommands of the ``secagg`` command line, one module each."""
