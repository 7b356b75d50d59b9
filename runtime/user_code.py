"""Import user code named in a spec as `package.module:function`, with errors that say which part failed.

Rewards and agents are both named this way; a typo must fail at start-up with a message naming the path, the
module and a did-you-mean, not as an AttributeError mid-run.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["load_callable"]


def load_callable(path: str, what: str, error: type[Exception] = ImportError) -> Callable[..., Any]:
    """Resolve `"pkg.module:function"` (the function part may be dotted); raise `error` with `what` in the text."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise error(f"{what} {path!r} must be 'pkg.module:function' with both parts non-empty")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise error(
            f"{what} {path!r}: cannot import module {module_name!r} ({exc}); is it installed or on PYTHONPATH?"
        ) from exc
    except Exception as exc:  # the user's module raised while importing
        raise error(f"{what} {path!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from exc
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise error(f"{what} {path!r}: module {module_name!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(f"{what} {path!r} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[return-value]
