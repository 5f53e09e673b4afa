"""Structured output, one owner for both services: which JSON Schema the engine constrains to, how a
request's `response_format` or forced tool call becomes a `Guide` (the spec the engine compiles into a
grammar), and the content hash a compiled grammar is cached under.

The gateway checks a schema here before anything is queued, naming the offending field in the 400; the
engine checks it again when the spec arrives (it trusts no caller) and compiles it. A schema keyword
outside `SUPPORTED_KEYWORDS` is refused, never ignored: the engine must not promise a shape it does not
enforce.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from services.common.wire import MAX_GUIDE_CHARS, InvalidRequest

MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_NODES = 2000

GUIDE_JSON_OBJECT = "json_object"
GUIDE_JSON_SCHEMA = "json_schema"
GUIDE_TOOL_CALLS = "tool_calls"
GUIDE_KINDS = (GUIDE_JSON_OBJECT, GUIDE_JSON_SCHEMA, GUIDE_TOOL_CALLS)

# The JSON Schema subset the engine enforces (docs/api.md lists it). Annotations are accepted and change
# nothing; every other keyword is a 400.
SUPPORTED_KEYWORDS = frozenset({
    "type", "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength", "pattern", "format",
})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                         "deprecated", "readOnly", "writeOnly", "strict", "discriminator"})
TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
FORMATS = frozenset({"date-time", "date", "time", "email", "uuid", "ipv4", "ipv6"})
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_REF = re.compile(r"^#/(\$defs|definitions)/([^/]+)$")


def _canonical(value: Any) -> str:
    # Key order is kept: a schema's property order is the order the output is written in.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Guide:
    """What a constrained request's output must be. `text` (canonical JSON) is what travels on the engine
    wire and what `key` hashes: equal specs share one compiled grammar, whoever sent them."""

    kind: str
    schema: dict[str, Any] | None = None  # json_schema
    tools: tuple[ToolSpec, ...] = ()  # tool_calls: calls to these
    parallel: bool = True  # tool_calls: more than one call allowed
    # tool_calls under `tool_choice: auto`: the model may answer in text or call; a call it opens must be
    # one of `tools` with valid arguments. Not optional: the answer is calls and nothing else.
    optional: bool = False

    @property
    def text(self) -> str:
        body: dict[str, Any] = {"type": self.kind}
        if self.kind == GUIDE_JSON_SCHEMA:
            body["schema"] = self.schema
        elif self.kind == GUIDE_TOOL_CALLS:
            body["tools"] = [{"name": t.name, "parameters": t.parameters} for t in self.tools]
            body["parallel"] = self.parallel
            if self.optional:
                body["optional"] = True
        return _canonical(body)

    @property
    def key(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @classmethod
    def parse(cls, text: Any, param: str = "sampling.guide") -> Guide:
        """From its wire text, checked as thoroughly as when the gateway built it."""
        if not isinstance(text, str) or len(text) > MAX_GUIDE_CHARS:
            raise InvalidRequest(f"{param} must be a JSON text of at most {MAX_GUIDE_CHARS} characters", param)
        try:
            body = json.loads(text)
        except ValueError:
            raise InvalidRequest(f"{param} is not valid JSON", param) from None
        if not isinstance(body, dict) or body.get("type") not in GUIDE_KINDS:
            raise InvalidRequest(f"{param}.type must be one of {list(GUIDE_KINDS)}", f"{param}.type")
        kind = body["type"]
        if kind == GUIDE_JSON_OBJECT:
            return cls(kind)
        if kind == GUIDE_JSON_SCHEMA:
            return cls(kind, schema=check_schema(body.get("schema"), f"{param}.schema"))
        tools = body.get("tools")
        if not isinstance(tools, list) or not tools:
            raise InvalidRequest(f"{param}.tools must be a non-empty list", f"{param}.tools")
        specs = tuple(check_tool(t, f"{param}.tools[{i}]") for i, t in enumerate(tools))
        return cls(kind, tools=specs, parallel=bool(body.get("parallel", True)), optional=body.get("optional") is True)


def check_tool(tool: Any, param: str) -> ToolSpec:
    if not isinstance(tool, dict):
        raise InvalidRequest(f"{param} must be an object", param)
    name = tool.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise InvalidRequest(f"{param}.name must be 1-64 letters, digits, underscores or dashes", f"{param}.name")
    if not isinstance(tool.get("description", ""), str):  # chat templates write it into the prompt
        raise InvalidRequest(f"{param}.description must be a string", f"{param}.description")
    params = tool.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    return ToolSpec(name, check_schema(params, f"{param}.parameters"))


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """A JSON schema inside the supported subset, or a 400 naming the first field that is not."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} must be a JSON schema object", param)
    _Walk(schema).node(schema, param, 0)
    return schema


class _Walk:
    def __init__(self, root: dict[str, Any]):
        self.root = root
        self.nodes = 0

    def node(self, s: Any, at: str, depth: int) -> None:
        if isinstance(s, bool):  # `true` / `false` schemas: anything / nothing
            return
        if not isinstance(s, dict):
            raise InvalidRequest(f"{at} must be a schema object", at)
        self.nodes += 1
        if depth > MAX_SCHEMA_DEPTH or self.nodes > MAX_SCHEMA_NODES:
            raise InvalidRequest(f"the schema is too large (at most {MAX_SCHEMA_DEPTH} levels and "
                                 f"{MAX_SCHEMA_NODES} subschemas)", at)
        for key, value in s.items():
            where = f"{at}.{key}"
            if key in ANNOTATIONS:
                continue
            if key not in SUPPORTED_KEYWORDS:
                raise InvalidRequest(f"unsupported JSON Schema keyword {key!r} at {where} (see docs/api.md for "
                                     f"the supported subset)", where, "unsupported_schema")
            self.keyword(key, value, where, depth)
        check_bounds(s, at)
        if ("minLength" in s or "maxLength" in s) and ("pattern" in s or "format" in s):
            where = f"{at}.{'pattern' if 'pattern' in s else 'format'}"
            raise InvalidRequest(f"{where} cannot be combined with minLength/maxLength", where, "unsupported_schema")

    def keyword(self, key: str, v: Any, at: str, depth: int) -> None:
        if key == "type":
            types = v if isinstance(v, list) else [v]
            if not types or any(not isinstance(t, str) or t not in TYPES for t in types):
                raise InvalidRequest(f"{at} must be one of {sorted(TYPES)} or a list of them", at, "invalid_schema")
        elif key == "enum":
            if not isinstance(v, list) or not v:
                raise InvalidRequest(f"{at} must be a non-empty list", at, "invalid_schema")
        elif key == "required":
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise InvalidRequest(f"{at} must be a list of property names", at, "invalid_schema")
        elif key in ("anyOf", "allOf", "prefixItems"):
            if not isinstance(v, list) or not v:
                raise InvalidRequest(f"{at} must be a non-empty list of schemas", at, "invalid_schema")
            if key == "allOf" and len(v) > 1:
                raise InvalidRequest(f"{at} may hold one schema only (merge them)", at, "unsupported_schema")
            for i, sub in enumerate(v):
                self.node(sub, f"{at}[{i}]", depth + 1)
        elif key in _SUBSCHEMA_MAPS:
            if not isinstance(v, dict):
                raise InvalidRequest(f"{at} must be an object of schemas", at, "invalid_schema")
            for name, sub in v.items():
                self.node(sub, f"{at}.{name}", depth + 1)
        elif key in ("additionalProperties", "items"):
            self.node(v, at, depth + 1)
        elif key == "$ref":
            self.ref(v, at)
        else:
            self.scalar(key, v, at)

    def ref(self, v: Any, at: str) -> None:
        m = _REF.match(v) if isinstance(v, str) else None
        if v == "#":
            return
        if m is None or not isinstance(self.root.get(m.group(1)), dict) or m.group(2) not in self.root[m.group(1)]:
            raise InvalidRequest(f"{at} must point at a definition of this schema (#/$defs/Name), got {v!r}",
                                 at, "invalid_schema")

    def scalar(self, key: str, v: Any, at: str) -> None:
        if key in ("minItems", "maxItems", "minLength", "maxLength"):
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 2**31 - 1:
                raise InvalidRequest(f"{at} must be a non-negative integer", at, "invalid_schema")
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) > 2**53:
                raise InvalidRequest(f"{at} must be a finite number", at, "invalid_schema")
        elif key == "pattern":
            try:
                if not isinstance(v, str) or len(v) > 1000:
                    raise TypeError
                re.compile(v)
            except (re.error, TypeError):
                raise InvalidRequest(f"{at} must be a valid regular expression", at, "invalid_schema") from None
        elif key == "format" and (not isinstance(v, str) or v not in FORMATS):
            raise InvalidRequest(f"unsupported format {v!r} at {at}; supported: {sorted(FORMATS)}", at,
                                 "unsupported_schema")


def check_bounds(schema: dict[str, Any], at: str) -> None:
    """Ranges that can hold no value (min > max) are a 400 here, before any grammar is compiled."""
    for lo, hi in (("minimum", "maximum"), ("minItems", "maxItems"), ("minLength", "maxLength")):
        a, b = schema.get(lo), schema.get(hi)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > b:
            raise InvalidRequest(f"{at}.{lo} is greater than {at}.{hi}", f"{at}.{lo}", "invalid_schema")
