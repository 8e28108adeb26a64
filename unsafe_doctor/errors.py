"""The one exception the core raises for bad input; the CLI turns it into a line on stderr and exit 2."""


class UsageError(Exception):
    """Bad usage or unreadable input. The message is shown to the user as one line."""
