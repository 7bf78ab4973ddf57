"""The base of the errors a user can cause and fix (a bad snapshot, a changed working directory, a damaged
expert block): the CLI prints their message, one sentence, instead of a traceback."""


class UserError(Exception):
    """An error whose message says what is wrong and what to do; no traceback is shown for it."""
