"""User-facing errors: the CLI prints their one-line message and exits with code 2, no traceback."""


class UserError(Exception):
    """A mistake the user can fix (bad config, missing data, unreadable input).

    The message must be a single line naming the file, key or value at fault and what to do.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
