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

    def _render_traceback_(self) -> list[str]:
        """What IPython (a notebook, the ``ipython`` shell) shows for it: the one line, no frames; the command
        line prints the same (``rayfl: error: ...``)."""
        return [f"rayfl: error: {self}"]


# ://user:password@ in a URI: the password is never printed (a literal start: linear in the text's length)
_CREDENTIALS = re.compile(r"://([^/\s:@'\"]*):[^/\s@'\"]*@")


def mask_credentials(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` in it replaced by ``***``."""
    return _CREDENTIALS.sub(r"://\1:***@", text) if "://" in text else text


MAX_MESSAGE = 2000  # characters of one error line (the longest own message, every config key listed, is ~900)


def same_value(value: Any) -> Any:
    """What makes two given values the same setting: a number by its value (1 and 1.0), anything else by repr."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ("number", float(value))
    return repr(value)


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean 'clients'?)`` for the nearest of ``choices`` (difflib's ratio, at least 0.6), else ''."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


KIND_TEXT = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}
MAX_COUNT = 10**7  # clients, rounds, batch sizes, samples, integer knobs: beyond any dataset or run rayfl holds
MAX_EPOCHS = 10_000  # passes over a client's data in one round or stage (local_epochs, a knob named *_epochs)
# A real number's magnitude, where it is not 0: beyond these a value is a typo that overflows (1e300 squared is
# infinite) or underflows (1e-300 of anything is 0), not a setting.
MAX_MAGNITUDE = 1e12
MIN_MAGNITUDE = 1e-12


def check_magnitude(value: float) -> None:
    """ValueError for a number whose magnitude is beyond [MIN_MAGNITUDE, MAX_MAGNITUDE] (0 is fine)."""
    if value != 0 and not MIN_MAGNITUDE <= abs(value) <= MAX_MAGNITUDE:
        raise ValueError(f"must be 0 or of magnitude in [{MIN_MAGNITUDE:g}, {MAX_MAGNITUDE:g}]")


def check_count(value: int, name: str = "") -> None:
    """ValueError for an integer beyond MAX_COUNT in magnitude (or MAX_EPOCHS, for a name ending in epochs)."""
    bound = MAX_EPOCHS if name.endswith("epochs") else MAX_COUNT
    if abs(value) > bound:
        raise ValueError(f"must be at most {bound:,}" + (" (passes over a client's data)" if bound == MAX_EPOCHS
                                                         else ""))


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
    if kind is float:
        check_magnitude(number)
    if kind is int:
        if isinstance(number, float) and not number.is_integer():
            raise ValueError(expected)
        return int(number)
    return number
