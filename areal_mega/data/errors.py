"""The one error type of the prompt data layer."""


class DataError(ValueError):
    """A dataset problem; the message names the file, the line/row and the field."""
