"""Bundled prompts: half input-grounded (the answer copies from the prompt), half open-ended.

Used by the greedy-identity tests, the core benchmark and the interim demo.
"""

from __future__ import annotations

from typing import Any

_WEATHER_SCHEMA = (
    '{"name": "get_weather", "description": "Current weather for a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", '
    '"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}'
)
_BOOKING_SCHEMA = (
    '{"name": "book_flight", "description": "Book a flight", "parameters": {"type": "object", '
    '"properties": {"origin": {"type": "string"}, "destination": {"type": "string"}, '
    '"date": {"type": "string", "format": "date"}, "passengers": {"type": "integer"}}, '
    '"required": ["origin", "destination", "date"]}}'
)
_CODE = '''def average(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2 == 0:
        return (ordered[middle - 1] + ordered[middle]) / 2
    return ordered[middle]
'''
_RECORD = (
    '{"order_id": "A-1043", "customer": {"name": "Ada Lovelace", "email": "ada@example.com", '
    '"address": {"street": "12 Analytical Way", "city": "London", "zip": "NW1 6XE"}}, '
    '"items": [{"sku": "BK-001", "title": "Notes on the Engine", "qty": 2, "price": 19.5}, '
    '{"sku": "PN-220", "title": "Brass Gear Set", "qty": 1, "price": 42.0}], '
    '"status": "shipped", "tracking": "1Z999AA10123456784"}'
)


def _user(text: str, system: str | None = None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": text}]


GROUNDED: list[Any] = [
    _user(f"Add type hints and a docstring to each function. Return the full code.\n\n{_CODE}"),
    _user(f"Rename the variable `values` to `numbers` everywhere in this code and return it:\n\n{_CODE}"),
    _user("Fix the bug in this code and return the corrected function:\n```python\n"
          "def is_even(n):\n    return n % 2 == 1\n\ndef count_even(items):\n    return sum(1 for i in items if is_even(i))\n```"),
    _user(f"Extract the customer's name, email and city from this JSON as a JSON object:\n{_RECORD}"),
    _user(f"Return this JSON with the status changed to \"delivered\":\n{_RECORD}"),
    _user(f"List every item's sku and title from this order as JSON lines:\n{_RECORD}"),
    _user("Convert this list to a markdown table with columns Name, Role, Team:\n"
          "- Alice Johnson, Engineer, Platform\n- Bob Smith, Designer, Growth\n"
          "- Carol White, Manager, Platform\n- Dan Brown, Engineer, Data\n- Eve Black, Analyst, Data"),
    _user("Translate this SQL to use explicit JOIN syntax and return it:\n"
          "SELECT o.id, c.name, o.total FROM orders o, customers c WHERE o.customer_id = c.id "
          "AND o.total > 100 ORDER BY o.total DESC;"),
    _user("Call the tool for: weather in Paris in celsius. Reply with the JSON call only.",
          system=f"You can call this tool by replying with JSON {{\"name\": ..., \"arguments\": ...}}:\n{_WEATHER_SCHEMA}"),
    _user("Book a flight from Boston to Denver on 2026-12-03 for 2 passengers. Reply with the JSON call only.",
          system=f"You can call this tool by replying with JSON {{\"name\": ..., \"arguments\": ...}}:\n{_BOOKING_SCHEMA}"),
]

OPEN: list[Any] = [
    _user("What is the capital of France?"),
    _user("Write a haiku about the ocean."),
    _user("Explain recursion to a ten-year-old in three sentences."),
    _user("Write a Python function that returns the n-th Fibonacci number."),
    _user("Give me three tips for staying focused while studying."),
    _user("What are the main differences between a list and a tuple in Python?"),
    _user("Write a short story opening about a lighthouse keeper."),
    _user("How do I reverse a string in JavaScript?"),
    "The three primary colors are",
    _user("Which tool would you call to learn tomorrow's weather in Rome, and with which arguments?",
          system=f"Tools available (JSON schema):\n{_WEATHER_SCHEMA}\n{_BOOKING_SCHEMA}"),
]

ALL_PROMPTS: list[Any] = GROUNDED + OPEN
