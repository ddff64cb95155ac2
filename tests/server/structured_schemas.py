"""The JSON-schema suite for structured outputs: schemas with a prompt a small chat model can answer.

Role: shared data for the structured-output server tests (test_structured_suite.py) and the
overhead benchmark (bench/structured_overhead.py); nothing here talks to an engine.

Invariants every `SchemaCase` keeps (the suite's own test checks them without a model):
- `schema` is a valid Draft 2020-12 JSON schema that llguidance compiles without warnings;
- `example` validates against it (so the schema is satisfiable), format assertions included;
- `name` is a valid OpenAI `json_schema.name` (`[A-Za-z0-9_-]{1,64}`), unique in `SCHEMAS`;
- most strings and arrays are bounded (maxLength / maxItems) so SmolLM2-135M finishes within
  ~256 tokens; the cases with `bounded=False` deliberately are not (or nest to any depth).
Pydantic cases are generated at import from the models below (`model_json_schema()` and the openai
SDK's strict form), so the suite follows whatever those libraries emit.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field


@dataclass(frozen=True)
class SchemaCase:
    name: str
    prompt: str
    schema: dict[str, Any]
    example: Any  # one instance the schema accepts: proof that it is satisfiable
    bounded: bool = True  # False: some string, array or number has no length bound


def _obj(props: dict[str, Any], required: list[str] | None = None, closed: bool = True) -> dict[str, Any]:
    """An object schema; every key required unless `required` says otherwise."""
    keys = list(props) if required is None else required
    out: dict[str, Any] = {"type": "object", "properties": props, "required": keys}
    if closed:
        out["additionalProperties"] = False
    return out


def _s(max_length: int = 40, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


def _int(lo: int | None = None, hi: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer"}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


# --- pydantic models (cases generated from them at the end) ---------------------------------------


class Genre(StrEnum):
    fiction = "fiction"
    science = "science"
    history = "history"


class Author(BaseModel):
    name: Annotated[str, Field(max_length=40)]
    born: Annotated[int, Field(ge=1000, le=2025)]


class Book(BaseModel):
    title: Annotated[str, Field(max_length=60)]
    genre: Genre
    authors: Annotated[list[Author], Field(min_length=1, max_length=2)]
    isbn: Annotated[str | None, Field(pattern=r"^[0-9]{13}$")] = None


class Appointment(BaseModel):
    patient: Annotated[str, Field(max_length=40)]
    day: dt.date
    start: dt.datetime
    confirmed: bool


class StepStatus(BaseModel):
    step: Annotated[str, Field(max_length=40)]
    done: bool


class Plan(BaseModel):
    goal: Annotated[str, Field(max_length=60)]
    steps: Annotated[list[StepStatus], Field(max_length=3)]
    priority: Literal["low", "medium", "high"]


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    score: Annotated[float, Field(ge=0.0, le=1.0)]


class Contact(BaseModel):
    name: Annotated[str, Field(max_length=40)]
    email: Annotated[str, Field(json_schema_extra={"format": "email"}, max_length=60)]
    phone: Annotated[str | None, Field(max_length=20)] = None
    tags: Annotated[list[Annotated[str, Field(max_length=15)]], Field(max_length=3)] = []


class Item(BaseModel):
    name: Annotated[str, Field(max_length=30)]
    quantity: Annotated[int, Field(ge=1, le=99)]


class ShoppingList(BaseModel):
    store: Annotated[str, Field(max_length=30)]
    items: Annotated[list[Item], Field(min_length=1, max_length=4)]


class Event(BaseModel):  # the openai SDK's strict form: every key required, optional ones nullable
    title: str
    date: str
    location: str | None
    attendees: list[str]


class Severity(StrEnum):
    minor = "minor"
    major = "major"


class Ticket(BaseModel):
    id: uuid.UUID
    severity: Severity | None
    summary: Annotated[str, Field(max_length=80)]


ADDRESS = _obj({"street": _s(), "city": _s(30), "zip": {"type": "string", "pattern": r"^[0-9]{5}$"}})
POINT = _obj({"x": {"type": "number"}, "y": {"type": "number"}})
TREE = {
    "$defs": {
        "node": _obj({"name": _s(12), "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}})
    },
    "$ref": "#/$defs/node",
}
DEPTH3_TREE = {  # recursion unrolled to three levels: leaves have no children
    "$defs": {
        "leaf": _obj({"name": _s(12)}),
        "mid": _obj({"name": _s(12), "children": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2}}),
        "top": _obj({"name": _s(12), "children": {"type": "array", "items": {"$ref": "#/$defs/mid"}, "maxItems": 2}}),
    },
    "$ref": "#/$defs/top",
}
SHAPE = {
    "anyOf": [
        _obj({"kind": {"const": "circle"}, "radius": {"type": "number", "exclusiveMinimum": 0}}),
        _obj({"kind": {"const": "rectangle"}, "width": {"type": "number", "exclusiveMinimum": 0},
              "height": {"type": "number", "exclusiveMinimum": 0}}),
    ]
}  # fmt: skip
PET = {
    "oneOf": [
        _obj({"species": {"const": "cat"}, "name": _s(20), "indoor": {"type": "boolean"}}),
        _obj({"species": {"const": "dog"}, "name": _s(20), "breed": _s(30)}),
    ]
}
MEMBER = _obj({"name": _s(30), "role": {"enum": ["engineer", "manager", "designer"]}})
TEAM = _obj({"name": _s(30), "members": {"type": "array", "items": MEMBER, "minItems": 1, "maxItems": 2}})
DEPARTMENT = _obj({"name": _s(30), "teams": {"type": "array", "items": TEAM, "minItems": 1, "maxItems": 2}})

_PERSON = {"name": "Ada", "age": 36}

# fmt: off
_HAND_WRITTEN: list[SchemaCase] = [
    # objects, required and optional keys
    SchemaCase("person", "Give a JSON object describing a fictional person with name and age.",
               _obj({"name": _s(), "age": _int(0, 120)}), _PERSON),
    SchemaCase("book_basic", "Describe a famous novel as JSON with title, author, year and whether it is available.",
               _obj({"title": _s(60), "author": _s(), "year": _int(1400, 2030), "available": {"type": "boolean"}}),
               {"title": "Emma", "author": "Jane Austen", "year": 1815, "available": True}),
    SchemaCase("city", "Describe the city of Paris as JSON, with its coordinates.",
               _obj({"name": _s(30), "country": _s(30), "population": _int(0),
                     "location": _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                       "lon": {"type": "number", "minimum": -180, "maximum": 180}})}),
               {"name": "Paris", "country": "France", "population": 2100000, "location": {"lat": 48.9, "lon": 2.35}}),
    SchemaCase("weather", "What is the weather like in London today? Answer as JSON.",
               _obj({"city": _s(30), "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
                     "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}, "humidity": _int(0, 100)}),
               {"city": "London", "temperature_c": 14.5, "condition": "rainy", "humidity": 80}),
    SchemaCase("user_optional", "Create a JSON user profile for a cat lover; only the username is required.",
               _obj({"username": _s(20, minLength=3), "bio": _s(80), "website": _s(60)}, required=["username"]),
               {"username": "catfan"}),
    SchemaCase("all_optional", "Give optional settings for a music player as JSON.",
               _obj({"volume": _int(0, 100), "shuffle": {"type": "boolean"}, "theme": {"enum": ["light", "dark"]}},
                    required=[]),
               {"shuffle": False}),
    SchemaCase("open_object", "Describe your favourite animal as a JSON object.",
               {"type": "object", "properties": {"animal": _s(30)}, "required": ["animal"]}, {"animal": "owl"}),
    SchemaCase("empty_closed_object", "Reply with an empty JSON object.",
               {"type": "object", "properties": {}, "additionalProperties": False}, {}),
    SchemaCase("any_object", "Give any JSON object about the moon.", {"type": "object"}, {}, bounded=False),
    SchemaCase("word_counts", "Count the words 'a', 'the' and 'cat' in 'the cat saw a cat' as a JSON map.",
               {"type": "object", "additionalProperties": _int(0, 100), "maxProperties": 3},
               {"the": 1, "cat": 2, "a": 1}),
    SchemaCase("pattern_props", "Give the ages of two friends as JSON, keyed by lowercase first name.",
               {"type": "object", "patternProperties": {"^[a-z]{1,10}$": _int(0, 120)},
                "additionalProperties": False, "minProperties": 1, "maxProperties": 2},
               {"anna": 30, "bob": 31}),
    SchemaCase("flags", "Which of these are true for a penguin: can fly, can swim, is a bird? JSON booleans.",
               _obj({"can_fly": {"type": "boolean"}, "can_swim": {"type": "boolean"}, "is_bird": {"type": "boolean"}}),
               {"can_fly": False, "can_swim": True, "is_bird": True}),
    # nesting
    SchemaCase("order", "Create a JSON order for two items from an online shop.",
               _obj({"order_id": _int(1, 999999), "customer": _obj({"name": _s(), "email": _s(60, format="email")}),
                     "items": {"type": "array", "minItems": 1, "maxItems": 3,
                               "items": _obj({"sku": {"type": "string", "pattern": r"^[A-Z]{3}-[0-9]{3}$"},
                                              "qty": _int(1, 10), "price": {"type": "number", "minimum": 0}})},
                     "total": {"type": "number", "minimum": 0}}),
               {"order_id": 7, "customer": {"name": "Bo", "email": "bo@example.com"},
                "items": [{"sku": "ABC-123", "qty": 2, "price": 3.5}], "total": 7.0}),
    SchemaCase("company_4_levels", "Describe a small software company with one department as JSON.",
               _obj({"company": _s(30), "departments": {"type": "array", "items": DEPARTMENT, "minItems": 1,
                                                         "maxItems": 1}}),
               {"company": "Acme", "departments": [{"name": "R&D", "teams": [
                   {"name": "Core", "members": [{"name": "Li", "role": "engineer"}]}]}]}),
    SchemaCase("server_config", "Write a JSON config for a web server listening on port 8080 with TLS on.",
               _obj({"server": _obj({"http": _obj({"port": _int(1, 65535),
                                                   "tls": _obj({"enabled": {"type": "boolean"}})})})}),
               {"server": {"http": {"port": 8080, "tls": {"enabled": True}}}}),
    SchemaCase("recipe", "Give a simple pancake recipe as JSON.",
               _obj({"title": _s(40), "servings": _int(1, 12),
                     "ingredients": {"type": "array", "maxItems": 4, "items": _obj({"item": _s(30), "amount": _s(20)})},
                     "steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": _s(80)}}),
               {"title": "Pancakes", "servings": 2, "ingredients": [], "steps": ["Mix and fry."]}),
    # enums and const
    SchemaCase("ticket_enums", "File a JSON bug ticket about a login page that crashes.",
               _obj({"title": _s(60), "priority": {"enum": ["low", "medium", "high"]},
                     "status": {"type": "string", "enum": ["open", "in_progress", "closed"]}}),
               {"title": "Login crash", "priority": "high", "status": "open"}),
    SchemaCase("mixed_enum", "Pick a setting for the fan speed as JSON: auto, 1, 2, off (null) or boost (true).",
               {"enum": ["auto", 1, 2, None, True]}, "auto"),
    SchemaCase("int_enum", "Which HTTP status code means 'not found'? Answer as JSON.",
               _obj({"code": {"type": "integer", "enum": [200, 404, 500]}}), {"code": 404}),
    SchemaCase("const_discriminator", "Log a JSON event for a user signing in.",
               _obj({"type": {"const": "event"}, "name": _s(30), "version": {"const": 2}}),
               {"type": "event", "name": "sign_in", "version": 2}),
    SchemaCase("top_const", "Do you agree? Answer yes in JSON.", {"const": "yes"}, "yes"),
    SchemaCase("top_enum_color", "What color is the sky on a clear day? Answer in JSON.",
               {"type": "string", "enum": ["red", "green", "blue"]}, "blue"),
    # anyOf / oneOf / allOf / unions
    SchemaCase("shape_anyof", "Describe a geometric shape as JSON.", SHAPE, {"kind": "circle", "radius": 1.5}),
    SchemaCase("pet_oneof", "Describe a pet as JSON.", PET, {"species": "dog", "name": "Rex", "breed": "Beagle"}),
    SchemaCase("id_anyof", "Give an identifier for a product as JSON; it may be a number or a code.",
               _obj({"id": {"anyOf": [_int(0, 10**6), _s(12)]}}), {"id": "AB12"}),
    SchemaCase("value_oneof", "Give the answer to 6 times 7 as JSON.",
               _obj({"answer": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}}), {"answer": 42}),
    SchemaCase("allof_merge", "Describe an employee as JSON with name and employee number.",
               {"allOf": [{"type": "object", "properties": {"name": _s()}, "required": ["name"]},
                          {"type": "object", "properties": {"number": _int(1, 9999)}, "required": ["number"]}]},
               {"name": "Kim", "number": 12}),
    SchemaCase("nullable_string", "Give a person's first and middle name as JSON (middle may be null).",
               _obj({"first": _s(20), "middle": {"type": ["string", "null"], "maxLength": 20}}),
               {"first": "Ann", "middle": None}),
    SchemaCase("nullable_int", "How many moons does Venus have? Use null if unknown. JSON.",
               _obj({"planet": _s(20), "moons": {"type": ["integer", "null"], "minimum": 0, "maximum": 200}}),
               {"planet": "Venus", "moons": 0}),
    SchemaCase("number_or_string", "What is the boiling point of water? JSON, value as number or text.",
               _obj({"value": {"type": ["number", "string"], "maxLength": 20}, "unit": {"enum": ["C", "F", "K"]}}),
               {"value": 100, "unit": "C"}),
    SchemaCase("top_union", "What is your nickname, if any? Answer as a JSON string or null.",
               {"type": ["string", "null"], "maxLength": 30}, None),
    # $ref / $defs
    SchemaCase("addresses_ref_twice", "Give billing and shipping addresses for an order as JSON.",
               {"$defs": {"address": ADDRESS},
                **_obj({"billing": {"$ref": "#/$defs/address"}, "shipping": {"$ref": "#/$defs/address"}})},
               {"billing": {"street": "1 Main St", "city": "Springfield", "zip": "12345"},
                "shipping": {"street": "2 Oak Ave", "city": "Shelbyville", "zip": "54321"}}),
    SchemaCase("points_ref_items", "Give the corners of a triangle as JSON points.",
               {"$defs": {"point": POINT}, **_obj({"points": {"type": "array", "items": {"$ref": "#/$defs/point"},
                                                              "minItems": 3, "maxItems": 3}})},
               {"points": [{"x": 0, "y": 0}, {"x": 1, "y": 0}, {"x": 0, "y": 1}]}),
    SchemaCase("ref_chain", "Describe a library with one shelf of books as JSON.",
               {"$defs": {"book": _obj({"title": _s(40)}),
                          "shelf": _obj({"label": _s(10), "books": {"type": "array", "items": {"$ref": "#/$defs/book"},
                                                                     "maxItems": 2}})},
                **_obj({"name": _s(30), "shelf": {"$ref": "#/$defs/shelf"}})},
               {"name": "City Library", "shelf": {"label": "A", "books": [{"title": "Dune"}]}}),
    SchemaCase("tree_recursive", "Describe a small family tree as nested JSON nodes.", TREE,
               {"name": "root", "children": [{"name": "kid", "children": []}]}, bounded=False),  # any depth
    SchemaCase("tree_depth3", "Describe a company org chart, three levels deep, as JSON.", DEPTH3_TREE,
               {"name": "CEO", "children": [{"name": "CTO", "children": [{"name": "Dev"}]}]}),
    SchemaCase("legacy_definitions", "Give the dimensions of a box in centimetres as JSON.",
               {"definitions": {"cm": {"type": "number", "minimum": 0, "maximum": 1000}},
                **_obj({"width": {"$ref": "#/definitions/cm"}, "height": {"$ref": "#/definitions/cm"},
                        "depth": {"$ref": "#/definitions/cm"}})},
               {"width": 10, "height": 20, "depth": 5}),
    # strings: patterns, formats, lengths
    SchemaCase("zip_pattern", "What is the ZIP code of the White House? JSON.",
               _obj({"zip": {"type": "string", "pattern": r"^[0-9]{5}$"}}), {"zip": "20500"}),
    SchemaCase("hex_color", "Give the hex code of pure red as JSON.",
               _obj({"name": _s(20), "hex": {"type": "string", "pattern": r"^#[0-9a-fA-F]{6}$"}}),
               {"name": "red", "hex": "#FF0000"}),
    SchemaCase("phone_pattern", "Give a fictional phone number as JSON.",
               _obj({"phone": {"type": "string", "pattern": r"^\+?[0-9]{7,12}$"}}), {"phone": "+15551234"}),
    SchemaCase("slug_pattern", "Make a URL slug for the article 'Hello World Again' as JSON.",
               _obj({"slug": {"type": "string", "pattern": r"^[a-z0-9]+(-[a-z0-9]+)*$", "maxLength": 40}}),
               {"slug": "hello-world-again"}),
    SchemaCase("semver", "What version is the latest release of your app? JSON, semantic versioning.",
               _obj({"version": {"type": "string", "pattern": r"^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$"}}),
               {"version": "1.2.3"}),
    SchemaCase("unanchored_pattern", "Give a flight number that contains an airline code like BA as JSON.",
               _obj({"flight": {"type": "string", "pattern": "[A-Z]{2}[0-9]{2,4}", "maxLength": 12}}),
               {"flight": "BA117"}),
    SchemaCase("date_format", "When did the first human land on the Moon? JSON date.",
               _obj({"event": _s(40), "date": {"type": "string", "format": "date"}}),
               {"event": "Moon landing", "date": "1969-07-20"}),
    SchemaCase("time_format", "At what time does a typical office open? JSON time with a UTC offset.",
               _obj({"opens": {"type": "string", "format": "time"}}), {"opens": "09:00:00Z"},
               bounded=False),  # RFC 3339 allows any number of fraction digits: greedy writes ".0000..."
    SchemaCase("datetime_format", "Schedule a meeting for next Monday morning as JSON.",
               _obj({"title": _s(40), "start": {"type": "string", "format": "date-time"}}),
               {"title": "Standup", "start": "2025-01-06T09:00:00Z"}, bounded=False),  # fraction digits, as above
    SchemaCase("email_format", "Give a fictional support email address as JSON.",
               _obj({"email": {"type": "string", "format": "email", "maxLength": 60}}), {"email": "help@example.com"}),
    SchemaCase("uuid_format", "Generate a random request id as JSON.",
               _obj({"request_id": {"type": "string", "format": "uuid"}}),
               {"request_id": "123e4567-e89b-12d3-a456-426614174000"}),
    SchemaCase("ipv4_format", "What is the IP address of a typical home router? JSON.",
               _obj({"device": _s(20), "ip": {"type": "string", "format": "ipv4"}}),
               {"device": "router", "ip": "192.168.1.1"}),
    SchemaCase("lengths", "Make a three-letter airport code and a short password as JSON.",
               _obj({"airport": {"type": "string", "minLength": 3, "maxLength": 3},
                     "password": {"type": "string", "minLength": 8, "maxLength": 16}}),
               {"airport": "LHR", "password": "hunter22"}),
    SchemaCase("unbounded_description", "Describe the ocean in one sentence as JSON.",
               _obj({"description": {"type": "string"}}), {"description": "Vast and blue."}, bounded=False),
    SchemaCase("top_string", "Say hello as a JSON string.", {"type": "string"}, "hello", bounded=False),
    # numbers, integers, booleans, null
    SchemaCase("number_bounds", "Give a product price and discount rate as JSON.",
               _obj({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                     "discount": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}}),
               {"price": 9.99, "discount": 0.1}),
    SchemaCase("negative_range", "What is the coldest temperature in Antarctica in Celsius? JSON.",
               _obj({"celsius": {"type": "number", "minimum": -100, "maximum": -1}}), {"celsius": -89.2}),
    SchemaCase("multiple_of", "Round 23 to the nearest multiple of 5 as JSON.",
               _obj({"rounded": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}}), {"rounded": 25}),
    SchemaCase("top_integer", "Rate the movie Titanic from 0 to 10 as a JSON number.", _int(0, 10), 8),
    SchemaCase("top_number", "What is the value of pi? Answer as a JSON number.", {"type": "number"}, 3.14,
               bounded=False),
    SchemaCase("top_boolean", "Is the Earth round? Answer as JSON true or false.", {"type": "boolean"}, True),
    SchemaCase("top_null", "Reply with JSON null.", {"type": "null"}, None),
    SchemaCase("null_property", "Report an operation result with no error as JSON.",
               _obj({"ok": {"type": "boolean"}, "error": {"type": "null"}}), {"ok": True, "error": None}),
    # arrays
    SchemaCase("top_array_strings", "List three fruits as a JSON array.",
               {"type": "array", "items": _s(20), "minItems": 2, "maxItems": 4}, ["apple", "pear", "fig"]),
    SchemaCase("top_array_ints", "Give five numbers between 1 and 100 as a JSON array.",
               {"type": "array", "items": _int(1, 100), "minItems": 3, "maxItems": 5}, [1, 2, 3]),
    SchemaCase("rgb_exact", "Give the RGB values of orange as JSON.",
               _obj({"rgb": {"type": "array", "items": _int(0, 255), "minItems": 3, "maxItems": 3}}),
               {"rgb": [255, 165, 0]}),
    SchemaCase("tuple_prefix", "Give a city name and its population as a JSON pair.",
               {"type": "array", "prefixItems": [_s(30), _int(0)], "items": False, "minItems": 2},
               ["Rome", 2800000]),
    SchemaCase("matrix", "Write the 2x2 identity matrix as JSON.",
               _obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                              "items": {"type": "array", "items": _int(-9, 9), "minItems": 2, "maxItems": 2}}}),
               {"rows": [[1, 0], [0, 1]]}),
    SchemaCase("tags_bounded", "Suggest tags for a blog post about hiking as JSON.",
               _obj({"tags": {"type": "array", "items": _s(15), "minItems": 1, "maxItems": 3}}), {"tags": ["hiking"]}),
    SchemaCase("unbounded_list", "List some colours of the rainbow as JSON.",
               _obj({"colors": {"type": "array", "items": _s(12)}}), {"colors": ["red"]}, bounded=False),
    SchemaCase("any_value", "Give any JSON value describing the number seven.", {}, 7, bounded=False),
]
# fmt: on


def _pydantic_cases() -> list[SchemaCase]:
    book = Book(title="Dune", genre=Genre.fiction, authors=[Author(name="Frank Herbert", born=1920)])
    appt = Appointment(patient="Sam", day=dt.date(2025, 3, 4), start=dt.datetime(2025, 3, 4, 9, 30, tzinfo=dt.UTC),
                       confirmed=True)  # fmt: skip
    plan = Plan(goal="Learn Spanish", steps=[StepStatus(step="Buy a book", done=False)], priority="medium")
    contact = Contact(name="Ana", email="ana@example.com")
    shopping = ShoppingList(store="Corner shop", items=[Item(name="milk", quantity=1)])
    event = Event(title="Party", date="2025-05-01", location=None, attendees=["Jo"])
    ticket = Ticket(id=uuid.UUID(int=1), severity=None, summary="Broken link")
    sentiment = Sentiment(label="positive", score=0.9)

    def dump(model: BaseModel) -> Any:
        return model.model_dump(mode="json")

    return [
        SchemaCase(
            "pydantic_book", "Describe a classic science fiction book as JSON.", Book.model_json_schema(), dump(book)
        ),
        SchemaCase(
            "pydantic_appointment",
            "Book a doctor's appointment for Sam next Tuesday at 9:30 UTC, as JSON.",
            Appointment.model_json_schema(),
            dump(appt),
        ),
        SchemaCase(
            "pydantic_plan", "Make a short plan to learn to cook, as JSON.", Plan.model_json_schema(), dump(plan)
        ),
        SchemaCase(
            "pydantic_sentiment",
            "Classify the sentiment of 'I love this phone!' as JSON.",
            Sentiment.model_json_schema(),
            dump(sentiment),
        ),
        SchemaCase(
            "pydantic_contact",
            "Create a JSON contact card for a fictional colleague.",
            Contact.model_json_schema(),
            dump(contact),
        ),
        SchemaCase(
            "openai_strict_shopping",
            "Write a short shopping list for breakfast as JSON.",
            to_strict_json_schema(ShoppingList),
            dump(shopping),
        ),
        SchemaCase(
            "openai_strict_event",
            "Plan a birthday party as JSON.",
            to_strict_json_schema(Event),
            dump(event),
            bounded=False,
        ),
        SchemaCase(
            "openai_strict_ticket",
            "Open a support ticket about a broken link as JSON.",
            to_strict_json_schema(Ticket),
            dump(ticket),
        ),
        SchemaCase("openai_strict_book", "Describe a history book as JSON.", to_strict_json_schema(Book), dump(book)),
    ]


SCHEMAS: tuple[SchemaCase, ...] = (*_HAND_WRITTEN, *_pydantic_cases())
BY_NAME: dict[str, SchemaCase] = {case.name: case for case in SCHEMAS}

# ~15 cases covering every feature, for the servers that run a subset (speculation, preemption).
SUBSET: tuple[SchemaCase, ...] = tuple(
    BY_NAME[name]
    for name in (
        "person", "order", "company_4_levels", "ticket_enums", "shape_anyof", "pet_oneof", "addresses_ref_twice",
        "tree_depth3", "hex_color", "date_format", "uuid_format", "number_bounds", "rgb_exact", "nullable_string",
        "pydantic_book", "openai_strict_shopping",
    )
)  # fmt: skip

# Models for the SDK's `parse` / `stream` helpers (response_format=<pydantic model>).
PARSE_MODELS: tuple[type[BaseModel], ...] = (Sentiment, ShoppingList, Plan)
