"""The kit's tasks: the extraction task copies a span of its prompt (what prompt lookup drafts from)."""
from __future__ import annotations

import random

from services.modelkit import corpus


def test_extract_answers_are_spans_of_the_prompt_and_the_asked_field():
    rng = random.Random(0)
    asked = set()
    for _ in range(300):
        ex = corpus.extract(rng)
        field = ex.prompt.split(".", 1)[0].removeprefix("Extract the ")
        asked.add(field)
        assert f" {field}: {ex.answer}" in ex.prompt  # the value of the asked field, copied verbatim
        assert ex.prompt.count(f" {field}: ") == 1
    assert asked == {"note", "address", "name"}

