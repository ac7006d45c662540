"""The ``weightsync`` command line: one module per command, composed in ``main``."""
