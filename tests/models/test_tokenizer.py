"""The tokenizer's ids are llama.cpp's own, whatever the text holds."""

from __future__ import annotations

from nemo_gym_prorl.models.tokenizer import StreamDecoder, Tokenizer

TEXTS = [
    "a",
    "<|im_start|>user\nList the files.<|im_end|>\n<|im_start|>assistant\n",
    "naïve café — 東京 🚀 " * 40,
    "\n\n\t  x" * 300,
    "<|im_end|><|im_end|><|endoftext|>",
    "".join(map(chr, range(1, 32))) * 20,  # a token for each byte: the most tokens a text can have
]


def test_encode_gives_llama_cpp_s_own_ids_for_special_tokens_multibyte_and_long_texts(tokenizer: Tokenizer) -> None:
    model = tokenizer._model
    for text in TEXTS:
        for add_bos in (False, True):
            assert tokenizer.encode(text, add_bos) == model.tokenize(text.encode(), add_bos, True), (text[:40], add_bos)
    assert tokenizer.encode("") == []


def test_a_stream_decoder_gives_each_prefix_s_text_piece_by_piece_and_never_splits_a_character(
    tokenizer: Tokenizer,
) -> None:
    text = "naïve café — 東京 🚀, then\n\tx = 1"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode(ids[:k]) for k in range(len(ids)))  # some character spans two tokens
    decoder, pieces = StreamDecoder(tokenizer), []
    for k, token in enumerate(ids, 1):
        pieces.append(decoder.push(token))
        assert "\ufffd" not in pieces[-1]
        cut = StreamDecoder(tokenizer)  # a generation cut after k tokens: what it held back comes at the end
        assert "".join(cut.push(t) for t in ids[:k]) + cut.flush() == tokenizer.decode(ids[:k])
    assert "".join(pieces) + decoder.flush() == text
    # resumed after k tokens whose text was given: the rest of the text, each piece with its leading space
    for k in range(1, len(ids)):
        if "\ufffd" not in (head := tokenizer.decode(ids[:k])):
            resumed = StreamDecoder(tokenizer, ids[:k])
            assert "".join(resumed.push(t) for t in ids[k:]) + resumed.flush() == text[len(head) :]
