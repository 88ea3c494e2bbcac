"""The one exception type a user sees.

Anything raised as `PymlError` is a problem with the user's input (a spec, a file, a shape); the CLI
prints its message on one line and exits with status 2, never a traceback.
"""


class PymlError(Exception):
    """A user-facing error: the message says what is wrong and, where it can, what to change."""
