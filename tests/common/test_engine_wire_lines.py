"""The internal stream's plain step line (`StreamItem.step_line`, written with orjson for speed) is byte for byte the
model's own encoding, for any text and tokens, so the gateway reads both alike."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from services.common.engine_wire import StreamItem

# Text as the engine's detokenizer makes it: valid Unicode (no lone surrogates), any code point including controls.
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(text=_text, token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=8))
def test_step_line_is_the_models_encoding(text, token_ids):
    line = StreamItem.step_line(text, token_ids)
    assert line == StreamItem(text=text, token_ids=token_ids).encode()
    assert StreamItem.decode(line) == StreamItem(text=text, token_ids=token_ids)
