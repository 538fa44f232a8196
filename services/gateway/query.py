"""Query-string rules shared by every gateway route: whole numbers as digits, booleans as
`true`/`false`, one value per name.

pydantic's lax integer parsing, which FastAPI applies to query parameters, also reads "1_0"
(as 10), "+1", " 1" and "1.0"; and FastAPI takes the last of a repeated parameter
(`?after=3&after=5` streamed from frame 5); a client that wrote either would get something
it did not mean. Every integer query parameter is therefore
`WholeNumber` (decimal digits, an optional leading minus so that a negative number still gets
its range error), and a parameter given twice is a 400 naming it (`single_query_values`, an
app-wide dependency).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

_WHOLE_NUMBER = re.compile(r"-?[0-9]+")


def _whole_number(value: Any) -> Any:
    """`value` unchanged when it is not text or is decimal digits (an optional leading minus);
    raises pydantic's error "Input should be a whole number in digits" otherwise."""
    if isinstance(value, str) and not _WHOLE_NUMBER.fullmatch(value):
        raise PydanticCustomError("whole_number", "Input should be a whole number in digits")
    return value


#: An integer query parameter written as digits (see the module docstring).
WholeNumber = Annotated[int, BeforeValidator(_whole_number)]


def _true_or_false(value: Any) -> Any:
    """`value` unchanged when it is not text or is "true" or "false"; raises pydantic's error
    "Input should be true or false" otherwise."""
    if isinstance(value, str) and value not in ("true", "false"):
        raise PydanticCustomError("true_or_false", "Input should be true or false")
    return value


#: A boolean query parameter written `true` or `false`: pydantic's lax booleans also read "1",
#: "yes", "on", "t", "y" (and their opposites) in any case, so that
#: `DELETE /assistant/chat/{id}?permanent=yes` would delete a chat for good.
TrueOrFalse = Annotated[bool, BeforeValidator(_true_or_false)]


async def single_query_values(request: Request) -> None:
    """Refuse a request that gives a query parameter more than once (400 `{"detail": "<name>:
    given more than once; give it once"}`): every query parameter of this API takes one value."""
    seen: set[str] = set()
    for name, _ in request.query_params.multi_items():
        if name in seen:
            raise RequestValidationError(
                [
                    {
                        "loc": ("query", name),
                        "msg": "given more than once; give it once",
                        "type": "value_error",
                    }
                ]
            )
        seen.add(name)
