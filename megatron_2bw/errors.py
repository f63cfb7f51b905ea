"""One exception type for every bad input, so entry points can print one line and exit."""


class ConfigError(ValueError):
    """A user-facing configuration error; its message is one line naming the problem."""
