"""The pydantic models the structured-output tests and bench ask for: nested objects, enums, bounded
arrays, ranged integers and optional fields (every string bounded, so a sampled answer ends)."""
from __future__ import annotations

import enum
from typing import Annotated, Optional

from pydantic import BaseModel, Field

from services.modelkit.corpus import DEMO_TOOLS, TIME_TOOL, WEATHER_TOOL  # noqa: F401 (re-exported for the tests)


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=16)
    zip_code: Optional[int] = Field(default=None, ge=1000, le=99999)


class Pet(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)
    color: Color
    tags: list[Annotated[str, Field(max_length=10)]] = Field(min_length=1, max_length=3)
    address: Address
    nickname: Optional[str] = Field(default=None, max_length=10)


class Tag(str, enum.Enum):
    cute = "cute"
    old = "old"
    loud = "loud"


class Owner(BaseModel):
    name: str = Field(max_length=12)
    pets: list[Pet] = Field(min_length=1, max_length=2)
    favourite: Optional[Color] = None
    rating: int = Field(ge=1, le=5)
    labels: list[Tag] = Field(max_length=2)


class Weather(BaseModel):
    city: str = Field(max_length=16)
    unit: Color


MODELS = [Pet, Owner, Address, Weather]

# The demo kit's tools (its base model is taught to call them: services/modelkit/corpus.py owns them).
TOOLS = DEMO_TOOLS
