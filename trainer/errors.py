"""The one error type programs print as a single line, and the helper that makes a line."""


class UserError(ValueError):
    """Bad input from the user (a flag, a file, a model). Programs print its one-line
    message, prefixed with `error: `, and exit 1."""


def one_line(e):
    """An exception from a library as one short line: its message with whitespace folded."""
    return " ".join(str(e).split()) or type(e).__name__
