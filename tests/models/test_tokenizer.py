"""The tokenizer's ids are llama.cpp's own, whatever the text holds."""

from __future__ import annotations

from nemo_gym_prorl.models.tokenizer import Tokenizer

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
