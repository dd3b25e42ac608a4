"""The one error type that the CLI turns into a one-line message and exit code 2."""


class ServesimError(Exception):
    """Bad input or an impossible configuration. The message names the file, line or value."""
