"""The structured prompt sets' data: records to extract into JSON of a schema, and requests for one of a few tools.

``json-extraction`` reads short real records shipped in OpenAI's ``evals`` wheel (``evals/registry/data``, read as
data), five schemas in turn, each asked with its schema in the prompt and as a strict ``json_schema`` response format:

=========  ==========================================  ===================================================
schema     records                                     what it exercises
=========  ==========================================  ===================================================
product    ``product-ie`` product titles (40)          strings, an enum, an integer, a number, an array
payment    ``invoices`` e-mails (78, up to 150 words)  an enum, an array of nested objects with a number
entities   ``ner_finance`` contract sentences          an array (up to 6) of objects with an enum
event      ``event_categories`` Windows event logs     enums, a boolean, a nested object with an integer
study      ``population_span_extraction`` abstracts    an enum, integers, an array of nested objects
=========  ==========================================  ===================================================

``tool-calls`` is generated from a fixed seed (no package holds such requests with their tools): each request
fits one of twelve OpenAI function tools (weather, calendar, currency and unit conversion, search, e-mail, stock
prices, translation, reminders, restaurants, directions, timers) and comes with one to three other tools as
distractors, ``tool_choice="required"``.
"""

from __future__ import annotations

import json
from random import Random

from specdeploy.exporter.bench.structured import function_tool

_N, _B = {"type": "number"}, {"type": "boolean"}


def _str(longest: int) -> dict:
    """A string of at most ``longest`` characters. Every string and number here is bounded, as a production
    extraction or tool schema bounds them: a small model that falls into a loop inside a value (``"john.john.john"``,
    ``1000000...``) must still close it, so every answer parses within ``--max-new-tokens``."""
    return {"type": "string", "maxLength": longest}


def _int(least: int, most: int) -> dict:
    """An integer in ``[least, most]`` (a bounded number of digits)."""
    return {"type": "integer", "minimum": least, "maximum": most}


_WORD, _S, _LONG = _str(24), _str(80), _str(100)  # a unit or a language; a name or a phrase; a short message


def _obj(properties: dict, required: tuple[str, ...]) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_COUNT = _int(0, 100_000_000)
SCHEMAS: dict[str, dict] = {
    "product": _obj({"brand": _S, "model": _S,
                     "category": {"type": "string", "enum": ["laptop", "memory card", "camera", "other"]},
                     "storage_gb": _int(0, 100_000), "screen_inches": _N,
                     "features": {"type": "array", "items": _str(40), "maxItems": 4}},
                    ("brand", "model", "category", "storage_gb")),
    "payment": _obj({"sender": _S, "recipient": _S,
                     "kind": {"type": "string", "enum": ["charge", "invoice", "receipt", "transfer", "other"]},
                     "amounts": {"type": "array", "maxItems": 4, "items": _obj(
                         {"value": _N, "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "CAD", "other"]}},
                         ("value", "currency"))},
                     "date": _S},
                    ("sender", "kind", "amounts")),
    "entities": _obj({"entities": {"type": "array", "maxItems": 6, "items": _obj(
        {"name": _str(48), "type": {"type": "string", "enum": ["PERSON", "ORGANIZATION", "LOCATION"]}}, ("name", "type"))}},
        ("entities",)),
    "event": _obj({"level": {"type": "string", "enum": ["Information", "Warning", "Error"]},
                   "component": _S, "succeeded": _B,
                   "update": _obj({"name": _S, "kb_number": _int(0, 99_999_999)}, ("name",))},
                  ("level", "component", "succeeded")),
    "study": _obj({"condition": _S,
                   "design": {"type": "string", "enum": ["randomized trial", "cohort", "case-control",
                                                         "cross-sectional", "review", "other"]},
                   "participants": _COUNT,
                   "groups": {"type": "array", "maxItems": 4, "items": _obj({"treatment": _S, "size": _COUNT},
                                                                            ("treatment",))}},
                  ("condition", "design", "participants")),
}
_ASK = {
    "product": ("Extract the product's details from this product title", "Title"),
    "payment": ("Extract the payment from this e-mail", "E-mail"),
    "entities": ("List the people, organizations and locations named in this sentence from a financial contract",
                 "Sentence"),
    "event": ("Extract the event's details from this Windows event log message", "Message"),
    "study": ("Extract the clinical study's design and participants from this abstract", "Abstract"),
}
PAYMENT_MAX_WORDS = 150
STUDY_MAX_WORDS = 200
ENTITY_MIN_WORDS = 12

# The template of workloads.json_template (a name, an age, an occupation and a city) as a schema.
PERSON_SCHEMA = _obj({"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 130}, "occupation": _S,
                      "city": _S}, ("name", "age", "occupation", "city"))


def extraction_prompt(schema_name: str, record: str) -> str:
    ask, label = _ASK[schema_name]
    return (f"{ask}. Reply with JSON only, matching this JSON schema:\n{json.dumps(SCHEMAS[schema_name])}\n\n"
            f"{label}: {record}")


def extraction_records(rows: dict[str, list[dict]]) -> dict[str, list[str]]:
    """Each schema's records, from the ``evals`` data files' rows (``rows[name]``: that file's JSON lines), deduplicated
    and in file order."""
    def user(r: dict) -> str:
        return next(m["content"] for m in r["input"] if m["role"] == "user")

    products = [user(r).split("\n Requested Attribute")[0].strip() for r in rows["product"]]
    emails = []
    for r in rows["payment"]:
        head = r["input"][0]["content"]
        body = head.split("EMAIL", 1)[1].strip() if "EMAIL" in head else ""
        if body and len(body.split()) <= PAYMENT_MAX_WORDS:
            emails.append(" ".join(body.split()))
    sentences = [user(r) for r in rows["entities"]
                 if len(user(r).split()) >= ENTITY_MIN_WORDS and "No entities" not in str(r.get("ideal"))]
    events = [user(r) for r in rows["event"]]
    abstracts = [" ".join(user(r).split()) for r in rows["study"] if len(user(r).split()) <= STUDY_MAX_WORDS]
    out = {"product": products, "payment": emails, "entities": sentences, "event": events, "study": abstracts}
    return {k: list(dict.fromkeys(v)) for k, v in out.items()}


# --- tool calls ---------------------------------------------------------------------------------------
_TIME = {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}
_DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
_CODE = {"type": "string", "pattern": "^[A-Z]{3}$"}
TOOLS: dict[str, dict] = {t["function"]["name"]: t for t in (
    function_tool("get_weather", "Current weather or today's forecast for a city.",
                  {"city": _S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ("city",)),
    function_tool("create_calendar_event", "Add an event to the user's calendar.",
                  {"title": _S, "date": _DATE, "start_time": _TIME, "duration_minutes": _int(1, 1440),
                   "attendees": {"type": "array", "items": _S, "maxItems": 8}}, ("title", "date", "start_time")),
    function_tool("convert_currency", "Convert an amount of money between currencies at today's rate.",
                  {"amount": _N, "from_currency": _CODE, "to_currency": _CODE}, ("amount", "from_currency", "to_currency")),
    function_tool("web_search", "Search the web and return the top results.",
                  {"query": _S, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}, ("query",)),
    function_tool("send_email", "Send an e-mail from the user's account.",
                  {"to": _str(48), "subject": _str(60), "body": _LONG}, ("to", "subject", "body")),
    function_tool("convert_units", "Convert a quantity from one unit to another.",
                  {"value": _N, "from_unit": _WORD, "to_unit": _WORD}, ("value", "from_unit", "to_unit")),
    function_tool("get_stock_price", "The latest price of a stock.",
                  {"symbol": _S, "exchange": {"type": "string", "enum": ["NASDAQ", "NYSE", "LSE", "TSE"]}}, ("symbol",)),
    function_tool("translate_text", "Translate a text into another language.",
                  {"text": _LONG, "target_language": _WORD}, ("text", "target_language")),
    function_tool("set_reminder", "Remind the user of something at a time.",
                  {"message": _LONG, "time": _TIME, "repeat": {"type": "string", "enum": ["none", "daily", "weekly"]}},
                  ("message", "time")),
    function_tool("book_restaurant", "Book a table at a restaurant.",
                  {"restaurant": _S, "party_size": {"type": "integer", "minimum": 1, "maximum": 20}, "date": _DATE,
                   "time": _TIME}, ("restaurant", "party_size", "date", "time")),
    function_tool("get_directions", "Directions between two places.",
                  {"origin": _S, "destination": _S,
                   "mode": {"type": "string", "enum": ["driving", "walking", "transit", "cycling"]}},
                  ("origin", "destination")),
    function_tool("start_timer", "Start a countdown timer.",
                  {"minutes": _int(1, 1440), "label": _S}, ("minutes",)),
)}
_CITIES = ("Oslo", "Lisbon", "Nairobi", "Osaka", "Lima", "Krakow", "Toronto", "Cairo", "Melbourne", "Porto", "Seoul",
           "Denver")
_PEOPLE = ("Ann Berg", "Omar Haddad", "Li Wei", "Maria Rossi", "Kofi Mensah", "Sara Novak", "Diego Ruiz", "Yuki Sato")
_SLOTS = {
    "city": _CITIES, "city2": _CITIES, "person": _PEOPLE, "person2": _PEOPLE,
    "amount": ("25", "120", "75.50", "1,000", "3,200", "48"), "cur": ("USD", "EUR", "GBP", "JPY", "CAD", "CHF"),
    "cur2": ("USD", "EUR", "GBP", "JPY", "CAD", "CHF"),
    "day": ("2025-03-14", "2025-04-02", "2025-05-21", "2025-06-09", "2025-07-30"),
    "time": ("08:30", "09:00", "12:15", "14:00", "17:45", "19:30"),
    "topic": ("the budget review", "the product launch", "a dentist appointment", "the team retrospective",
              "a call with the bank"),
    "query": ("the best hiking trails near Porto", "how to repot an orchid", "reviews of the Framework laptop",
              "train times from Oslo to Bergen", "the history of the printing press"),
    "qty": ("5", "12.5", "100", "3", "42", "0.75"),
    "units": (("miles", "kilometers"), ("pounds", "kilograms"), ("liters", "gallons"), ("feet", "meters"),
              ("celsius", "fahrenheit")),
    "stock": (("AAPL", "NASDAQ"), ("IBM", "NYSE"), ("SONY", "TSE"), ("HSBA", "LSE"), ("MSFT", "NASDAQ")),
    "phrase": ("Where is the train station?", "Thank you for your help.", "The meeting is postponed to Friday.",
               "Could you send me the invoice?"),
    "lang": ("French", "German", "Japanese", "Spanish", "Portuguese"),
    "chore": ("take out the recycling", "call my mother", "water the plants", "pay the electricity bill"),
    "restaurant": ("Casa Lima", "The Green Fork", "Sushi Taro", "Trattoria Roma"), "party": ("2", "4", "6", "3"),
    "minutes": ("5", "10", "25", "45"), "mode": ("walking", "transit", "cycling", "driving"),
}
REQUESTS: dict[str, tuple[str, ...]] = {
    "get_weather": ("What's the weather like in {city} right now?", "Do I need an umbrella in {city} today?"),
    "create_calendar_event": ("Put {topic} in my calendar on {day} at {time} for an hour, with {person}.",
                              "Schedule {topic} for {day} at {time}."),
    "convert_currency": ("How much is {amount} {cur} in {cur2}?", "Convert {amount} {cur} to {cur2}, please."),
    "web_search": ("Search the web for {query}.", "Find me a few links about {query}."),
    "send_email": ("Email {person} that {topic} moves to {day}.",
                   "Send a short note to {person} thanking them for {topic}."),
    "convert_units": ("How many {unit_to} is {qty} {unit_from}?", "Convert {qty} {unit_from} into {unit_to}."),
    "get_stock_price": ("What is {symbol} trading at on the {exchange}?", "Give me the latest {symbol} share price."),
    "translate_text": ("Translate '{phrase}' into {lang}.", "How do I say '{phrase}' in {lang}?"),
    "set_reminder": ("Remind me to {chore} at {time}.", "Set a daily reminder at {time} to {chore}."),
    "book_restaurant": ("Book a table for {party} at {restaurant} on {day} at {time}.",
                        "Reserve {restaurant} for {party} people, {day}, {time}."),
    "get_directions": ("How do I get from {city} station to {city2} airport by {mode}?",
                       "Directions from {person}'s office in {city} to the harbour, {mode}."),
    "start_timer": ("Start a {minutes}-minute timer for the pasta.", "Set a timer for {minutes} minutes."),
}


def tool_requests(count: int, seed: int = 0) -> list[tuple[str, tuple[dict, ...]]]:
    """``count`` (request, tools) pairs: request ``i`` fits tool ``i`` modulo twelve, worded from a fixed seed, with
    one to three distractor tools, the fitting one at a random place."""
    names = list(TOOLS)
    out = []
    for i in range(count):
        rng = Random(seed * 100_003 + i)
        name = names[i % len(names)]
        slots = {k: rng.choice(v) for k, v in _SLOTS.items()}
        for first, second in (("cur", "cur2"), ("city", "city2"), ("person", "person2")):  # two different ones
            slots[second] = rng.choice([v for v in _SLOTS[second] if v != slots[first]])
        slots["unit_from"], slots["unit_to"] = slots.pop("units")
        slots["symbol"], slots["exchange"] = slots.pop("stock")
        text = rng.choice(REQUESTS[name]).format(**slots)
        tools = [TOOLS[n] for n in rng.sample([n for n in names if n != name], rng.randint(1, 3))]
        tools.insert(rng.randint(0, len(tools)), TOOLS[name])
        out.append((text, tuple(tools)))
    return out
