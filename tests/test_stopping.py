import random

import pytest

from baton.sampling import SamplingParams
from baton.engine.stopping import FinishReason, IncrementalDetokenizer, StopChecker

# A byte-level fake tokenizer: each id is a byte string, as in GPT-2 style BPE vocabularies.
EOS = 0
PIECES = {
    EOS: b"", 1: b"Hel", 2: b"lo", 3: b" wo", 4: b"rld", 5: b"!",
    6: b"\xc3", 7: b"\xa9",  # "é" split over two tokens
    8: b"\xe2", 9: b"\x82", 10: b"\xac",  # "€" over three
    11: b"<", 12: b"en", 13: b"d>tail", 14: b" x",
    15: b"\xf0\x9f", 16: b"\x8e\x89",  # "🎉" over two
}


def decode(ids):
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def checker(**kwargs) -> StopChecker:
    options = {k: kwargs.pop(k) for k in ("eos_token_ids", "prompt_ids", "max_model_len") if k in kwargs}
    return StopChecker(SamplingParams(**{"max_tokens": 100, **kwargs}), decode, **options)


def feed(stop_checker: StopChecker, ids) -> list[str]:
    """Feed tokens until the request ends; every streamed prefix must be a prefix of the result."""
    deltas = []
    for token in ids:
        out = stop_checker.append(token)
        deltas.append(out.text_delta)
        assert "".join(deltas) == stop_checker.text
        if out.finish_reason is not None:
            break
    assert stop_checker.text.startswith("".join(deltas))
    return deltas


# --- stop strings ----------------------------------------------------------------------------

def test_stop_string_spanning_tokens_is_cut_and_never_streamed():
    c = checker(stop=("lo wo",))
    deltas = feed(c, [1, 2, 3, 4, 5])
    assert deltas == ["He", "l", ""]  # "l", then "lo", could start the stop string: held back
    assert (c.text, c.finish_reason, c.stop_reason) == ("Hel", FinishReason.STOP, "lo wo")
    assert c.token_ids == (1, 2, 3)  # up to and including the token that completed it


def test_text_after_the_stop_string_in_the_same_token_is_dropped():
    c = checker(stop=("<end>",))
    feed(c, [1, 11, 12, 13, 5])
    assert (c.text, c.finish_reason, c.token_ids) == ("Hel", FinishReason.STOP, (1, 11, 12, 13))


def test_held_back_text_is_released_once_ruled_out():
    c = checker(stop=("<end>",))
    assert feed(c, [1, 11, 14]) == ["Hel", "", "< x"]
    assert not c.finished


def test_the_stop_string_completed_first_wins():
    c = checker(stop=("Hello world", "lo w"))
    feed(c, [1, 2, 3, 4])
    assert (c.text, c.stop_reason) == ("Hel", "lo w")


def test_stop_string_beats_length_on_the_same_token():
    c = checker(stop=("lo wo",), max_tokens=3)
    feed(c, [1, 2, 3])
    assert (c.text, c.finish_reason) == ("Hel", FinishReason.STOP)


# --- partial UTF-8 ---------------------------------------------------------------------------

def test_partial_utf8_is_held_until_the_character_completes():
    c = checker()
    deltas = feed(c, [1, 6, 7, 8, 9, 10, 15, 16])
    assert deltas == ["Hel", "", "é", "", "", "€", "", "🎉"]
    assert c.text == "Helé€🎉"


def test_incomplete_character_at_the_end_is_released_as_replacement():
    c = checker(max_tokens=2)
    assert feed(c, [1, 8]) == ["Hel", "\ufffd"]
    assert c.text == decode(c.token_ids)


def test_invalid_bytes_stream_as_replacement_once_followed_by_text():
    c = checker()
    deltas = feed(c, [1] + [8] * 8 + [2])  # lead bytes that never complete
    assert "".join(deltas) == "Hel" + "\ufffd" * 8 + "lo" == decode(c.token_ids)


def test_runs_of_tokens_ending_mid_character_stream_whole_characters():
    euros = ("€" * 12).encode()  # each token completes one "€" and starts the next
    vocab = [euros[:2]] + [euros[i:i + 3] for i in range(2, len(euros) - 1, 3)] + [euros[-1:]]
    sizes = []

    def chained_decode(ids):
        sizes.append(len(ids))
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    c = StopChecker(SamplingParams(), chained_decode)
    deltas = feed(c, range(len(vocab)))
    assert deltas == [""] + ["€"] * 12 and max(sizes) <= 12


# --- stop ids, EOS, length -------------------------------------------------------------------

def test_stop_token_id_ends_without_its_text_and_flushes_held_text():
    c = checker(stop=("<end>",), stop_token_ids=(5,))
    assert feed(c, [1, 11, 5, 2]) == ["Hel", "", "<"]
    assert (c.text, c.finish_reason, c.stop_reason, c.token_ids) == ("Hel<", FinishReason.STOP, 5, (1, 11, 5))


def test_eos_stops_unless_ignored():
    c = checker(eos_token_ids={EOS})
    feed(c, [1, 2, EOS, 3])
    assert (c.text, c.finish_reason, c.stop_reason, c.token_ids) == ("Hello", FinishReason.STOP, EOS, (1, 2, EOS))
    c = checker(eos_token_ids={EOS}, ignore_eos=True, max_tokens=4)
    feed(c, [1, 2, EOS, 3])
    assert (c.text, c.finish_reason, c.token_ids) == ("Hello wo", FinishReason.LENGTH, (1, 2, EOS, 3))


def test_max_tokens_ends_with_length_and_flushes_held_text():
    c = checker(max_tokens=2, stop=("<end>",))
    assert feed(c, [1, 11, 2]) == ["Hel", "<"]
    assert (c.text, c.finish_reason, c.stop_reason) == ("Hel<", FinishReason.LENGTH, None)
    with pytest.raises(RuntimeError, match="already finished"):
        c.append(2)


def test_context_limit_ends_with_length():
    c = checker(prompt_ids=[1, 2, 3, 4, 5], max_model_len=7)
    feed(c, [1, 2, 3, 4])
    assert (c.token_ids, c.finish_reason) == ((1, 2), FinishReason.LENGTH)


# --- detokenization window -------------------------------------------------------------------

def test_decoding_cost_does_not_grow_with_the_output():
    sizes = []

    def spy(ids):
        sizes.append(len(ids))
        return decode(ids)

    c = StopChecker(SamplingParams(max_tokens=500, stop=("never",)), spy, prompt_ids=[1] * 50)
    feed(c, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 16] * 40)
    assert c.text == decode(c.token_ids) and max(sizes) <= 8


def test_prompt_context_gives_sentencepiece_tokens_their_leading_space():
    pieces = {1: "▁Hello", 2: "▁world", 3: ","}

    def sp_decode(ids):  # SentencePiece drops the space of the text's first word
        text = "".join(pieces[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text

    detok = IncrementalDetokenizer(sp_decode, context_ids=[1])
    assert [detok.push(2), detok.push(3), detok.push(2)] == [" world", ",", " world"]
    c = StopChecker(SamplingParams(), sp_decode, prompt_ids=[1])
    assert feed(c, [2, 3]) == [" world", ","]


def test_random_streams_cut_exactly_at_the_stop_string():
    rng = random.Random(0)
    alphabet = "ab <>é€🎉"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        data = text.encode()
        cuts = sorted(rng.sample(range(1, len(data)), k=min(len(data) - 1, rng.randint(0, 12))))
        vocab = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
        stop = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
        c = StopChecker(SamplingParams(max_tokens=len(vocab), stop=(stop,)),
                        lambda ids: b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace"))
        deltas = feed(c, range(len(vocab)))
        expected = text[:text.find(stop)] if stop in text else text
        assert c.text == expected and "\ufffd" not in "".join(deltas), (text, stop, vocab)
        assert c.finish_reason == (FinishReason.STOP if stop in text else FinishReason.LENGTH)
