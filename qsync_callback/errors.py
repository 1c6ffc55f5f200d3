"""Errors the user can act on.

`QSyncInputError` is raised for bad input (a missing or corrupt trace, a plan for another model,
an impossible budget). Its message is one line that names the file or value and what is wrong;
the CLI prints it without a traceback and exits with code 2.
"""


class QSyncInputError(ValueError):
    """Bad input: the message says which file or value, and what is wrong with it."""
