"""The one exception type users see: a message that says what is wrong and what to do."""


class SelfdraftError(Exception):
    """A user-facing error. The CLI prints its message (no traceback) and exits with status 2."""
