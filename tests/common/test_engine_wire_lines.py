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


@settings(max_examples=300, deadline=None)
@given(text=_text, token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=8))
def test_step_of_reads_a_plain_step_as_decode_does(text, token_ids):
    line = StreamItem.step_line(text, token_ids)[:-1]
    assert StreamItem.step_of(line) == (text, token_ids)
    item = StreamItem.decode(line)
    assert (item.text, item.token_ids) == StreamItem.step_of(line)


_other_items = st.one_of(
    st.builds(lambda t, r: StreamItem(text=t, token_ids=[1], finish_reason=r), _text, st.sampled_from(["stop", "length"])),
    st.builds(lambda t: StreamItem(text=t, token_ids=[2], usage={"prompt_tokens": 1, "cached_tokens": 0,
                                                                 "completion_tokens": 1}), _text),
    st.builds(lambda m: StreamItem(error={"message": m, "type": "server_error"}, fault="engine"), _text),
    st.builds(lambda t: StreamItem(text=t, token_ids=[3], logprobs=[{"token": "a", "token_id": 3, "logprob": -0.5, "top": []}]), _text),
)


@settings(max_examples=200, deadline=None)
@given(item=_other_items)
def test_step_of_leaves_every_other_line_to_decode(item):
    assert StreamItem.step_of(item.encode()[:-1]) is None


@settings(max_examples=300, deadline=None)
@given(line=st.binary(max_size=60) | st.sampled_from([b'{"text": 1, "token_ids": []}', b'{"text": "a", "token_ids": [1.5]}',
                                                     b'{"text": "a", "token_ids": [true]}', b'{"text": "a", "ids": [1]}',
                                                     b'["text", "token_ids"]', b'{"text": "a", "token_ids": "1"}']))
def test_step_of_takes_nothing_decode_would_refuse_or_read_otherwise(line):
    step = StreamItem.step_of(line)
    if step is not None:  # whatever it takes, decode reads the same way
        item = StreamItem.decode(line)
        assert (item.text, item.token_ids) == step and item.finish_reason is None and item.usage is None
