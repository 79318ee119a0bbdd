"""What every module that refuses a user's input shares: :class:`UserError`, the nearest allowed name, and a
value read as the kind a setting has.

It imports no other rayfl module, so that the config and the modules whose names it checks (algorithms,
datasets, models) can all use it without importing one another.
"""

from __future__ import annotations

import math
import re
from typing import Any


class UserError(Exception):
    """A mistake in what the user asked for: shown as one line, exit status 2, no traceback.

    The message is kept to one line of at most MAX_MESSAGE characters (the middle elided), whatever value it
    quotes: values are quoted through :func:`rayfl.config.shown`, and this is the net under every other quotation."""

    def __init__(self, message: Any = "", *args):
        if isinstance(message, str):
            message = mask_credentials(message).replace("\r", "\\r").replace("\n", "\\n")
            if len(message) > MAX_MESSAGE:
                half = MAX_MESSAGE // 2
                message = f"{message[:half]} ...[{len(message) - 2 * half} characters]... {message[-half:]}"
        super().__init__(message, *args)


# scheme://user:password@ in a URI: the password is never printed
_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@'\"]*):[^/\s@'\"]*@")


def mask_credentials(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` in it replaced by ``***``."""
    return _CREDENTIALS.sub(r"\1:***@", text)


MAX_MESSAGE = 2000  # characters of one error line (the longest own message, every config key listed, is ~900)


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean 'clients'?)`` for the nearest of ``choices`` (difflib's ratio, at least 0.6), else ''."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


KIND_TEXT = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}


def to_kind(value: Any, kind: type) -> Any:
    """``value`` as a bool, int, float or str, or ValueError saying what is allowed.

    No silent coercion: null, a boolean where a number belongs, 2.5 for an integer, NaN or infinity,
    and a list where a scalar belongs are refused; '3' and 3.0 are an integer, 'yes' and 'off' booleans."""
    expected = f"must be {KIND_TEXT.get(kind, kind.__name__)}"
    if value is None or isinstance(value, (list, tuple, dict, set)):
        raise ValueError(expected)
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(expected)
    if isinstance(value, bool):
        raise ValueError(expected + ", not a boolean")
    if kind is str:
        return value if isinstance(value, str) else str(value)
    if kind not in (int, float):
        return value
    try:
        number = value if isinstance(value, int) else float(value)
        if kind is float:
            number = float(number)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(expected) from None
    if isinstance(number, float) and not math.isfinite(number):
        raise ValueError("must be a finite number")
    if kind is int:
        if isinstance(number, float) and not number.is_integer():
            raise ValueError(expected)
        return int(number)
    return number
