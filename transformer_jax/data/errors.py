"""The error the input pipeline raises for a problem with the user's data or dataset settings."""


class DataError(ValueError):
    """A dataset that is missing, empty, unreadable or inconsistent with its settings; the message
    names the file, split or setting. (A ValueError, so existing ``except ValueError`` still works.)"""
