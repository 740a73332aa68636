"""Choice-valued config keys: declared as ``Literal`` types next to their owner, checked once there."""
from __future__ import annotations

from typing import Any, Tuple, get_args


def options(choices: Any) -> Tuple[Any, ...]:
    """The values a ``Literal[...]`` type allows, in order."""
    return get_args(choices)


def alternatives(allowed: Tuple[Any, ...]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    names = [str(a) for a in allowed]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def check_choice(key: str, value: Any, choices: Any, template: str = "{key} must be {alternatives}, got {value!r}"
                 ) -> None:
    """Raise ValueError naming ``key`` and the allowed values when ``value`` is not one of ``choices``.

    ``template`` may use {key}, {value}, {alternatives} ('a, b or c') and {joined} ('a, b, c')."""
    allowed = options(choices)
    if value not in allowed:
        raise ValueError(template.format(key=key, value=value, alternatives=alternatives(allowed),
                                         joined=", ".join(map(str, allowed)), allowed=allowed))
