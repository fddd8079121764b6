"""The one exception type for user mistakes: the CLI prints its message as one sentence and exits non-zero."""


class DliteError(Exception):
    """A problem the user can fix (bad config, missing input, unknown name); never a bug in dlite."""
