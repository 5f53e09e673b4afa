"""The pydantic models the structured-output tests and bench ask for: nested objects, enums, bounded
arrays, ranged integers and optional fields (every string bounded, so a sampled answer ends)."""
from __future__ import annotations

import enum
from typing import Annotated, Optional

from pydantic import BaseModel, Field


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

# Small on purpose: the demo model has 512 positions and its tokenizer spends a token on most JSON characters.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "time",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
