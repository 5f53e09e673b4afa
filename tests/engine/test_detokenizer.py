"""Incremental detokenization never emits half a character; stop strings match across tokens."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.engine.detokenizer import DecodeStream, StopMatcher, TokenizerInfo

TEXT = "Grüße aus Köln, café naïve über 😀 — 東京 and plain ascii words " * 3


@pytest.fixture(scope="module")
def info(tmp_path_factory) -> TokenizerInfo:
    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<s>", "<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 10, trainer)
    tok.save(str(d / "tokenizer.json"))
    return TokenizerInfo(d)


def test_some_tokens_split_multibyte_characters(info):
    ids = info.encode(TEXT)
    assert any(not _valid_utf8(info.token_bytes[i]) for i in ids)


def test_incremental_equals_full_decode_and_never_emits_replacement(info):
    ids = info.encode(TEXT)
    stream = DecodeStream(info)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == info.decode(ids) == TEXT
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_are_skipped_or_kept(info):
    end = info.tokenizer.token_to_id("<|end|>")
    ids = info.encode("hi") + [end]
    assert "".join(DecodeStream(info).push(i) for i in ids) == "hi"
    assert "".join(DecodeStream(info, skip_special_tokens=False).push(i) for i in ids) == "hi<|end|>"


def test_truncated_character_is_replaced_only_at_flush(info):
    first_byte = "😀".encode()[:1]  # every single byte is in a byte-level vocabulary
    token = info.token_bytes.index(first_byte)
    stream = DecodeStream(info)
    assert stream.push(token) == ""
    assert stream.flush() == "\ufffd"


def test_stop_string_across_pieces_is_cut_and_held_back_text_released():
    m = StopMatcher(("END",))
    assert m.push("abc E") == ("abc ", False)  # "E" might start "END": held back
    assert m.push("N") == ("", False)
    assert m.push("Dxyz") == ("", True)
    assert m.text == "abc "
    m2 = StopMatcher(("END",))
    assert m2.push("xE") == ("x", False)
    assert m2.push("q") == ("Eq", False)  # not a stop after all: released


def test_first_of_several_stops_wins_and_unchecked_text_passes():
    m = StopMatcher(("bb", "a"))
    assert m.push("xxbba") == ("xx", True)
    m2 = StopMatcher(("a",))
    assert m2.push("aaa", check=False) == ("aaa", False)


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_ids_past_the_tokenizer_vocab_decode_to_nothing(info):
    # Checkpoints often pad the embedding matrix past the tokenizer's vocabulary; a random or
    # badly trained model can sample those ids, which must not crash the step loop.
    ids = info.encode("héllo wörld")
    ds = DecodeStream(info)
    text = "".join(ds.push(i) for i in [ids[0], info.vocab_size, info.vocab_size + 7, *ids[1:]]) + ds.flush()
    assert text == info.decode(ids)
