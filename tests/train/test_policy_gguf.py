"""The trainer's torch weights as the GGUF our llama.cpp server samples from: the file keeps the source's metadata,
loads back into the same weights, and the log-prob llama.cpp returns for each sampled token is the one torch
computes for it, before and after the weights change."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from nemo_gym_prorl.contracts.sampling import SamplingParams
from nemo_gym_prorl.models.engine import LlamaEngine
from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.train.policy_gguf import load_policy, write_policy_gguf

CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant who answers questions about arithmetic and science."},
    {"role": "user", "content": "What is 17 times 23? Explain how you compute it step by step."},
    {"role": "assistant", "content": "17 times 23 is 391. 17 times 20 is 340, 17 times 3 is 51, and 340 + 51 = 391."},
    {"role": "user", "content": "Why does ice float on water? Give two reasons and keep it short."},
    {
        "role": "assistant",
        "content": "Ice is less dense than liquid water: its molecules form an open hexagonal lattice held by "
        "hydrogen bonds, and that lower density makes it buoyant.",
    },
    {"role": "user", "content": "Which planet is closest to the sun, and how long is its year?"},
    {
        "role": "assistant",
        "content": "Mercury is the closest planet to the sun. It goes around the sun once every 88 Earth days, so its "
        "year is much shorter than ours, although one of its days lasts longer than that year.",
    },
    {"role": "user", "content": "Now write a short paragraph about the water cycle for a ten year old."},
]
GENERATED = 64


@pytest.fixture(scope="module")
def policy() -> tuple[Any, Any]:
    torch.manual_seed(0)
    return load_policy(default_gguf())


@pytest.fixture(scope="module")
def written(policy: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("policy") / "policy.gguf"
    started = time.perf_counter()
    write_policy_gguf(policy[0], default_gguf(), out)
    print(f"\nwrite_policy_gguf: {time.perf_counter() - started:.2f} s (first write: reads the source's metadata)")
    return out


def _fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def test_written_gguf_is_f32_with_every_source_key(written: Path) -> None:
    source, copy_ = gguf.GGUFReader(default_gguf()), gguf.GGUFReader(written)
    expected = _fields(source) | {"general.file_type": int(gguf.LlamaFileType.ALL_F32)}
    assert _fields(copy_) == expected
    assert [t.name for t in copy_.tensors] == [t.name for t in source.tensors]  # tied: no output.weight
    assert {t.tensor_type for t in copy_.tensors} == {gguf.GGMLQuantizationType.F32}
    assert [f.name for f in written.parent.iterdir()] == [written.name]  # no temp file left


def test_the_policy_is_a_plain_fp32_model_and_its_gguf_reads_back_as_the_same_weights(policy: tuple[Any, Any], written: Path) -> None:
    """transformers' own GGUF reading (what `from_pretrained(gguf_file=...)` runs; the whole load takes ~20 s more)
    gives back every weight bit for bit, and the config it builds is the model's."""
    model = policy[0]
    assert getattr(model, "hf_quantizer", None) is None and "quantization_config" not in model.config.to_dict()
    assert all(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the GGUF (no output.weight) says
    parsed = load_gguf_checkpoint(written, return_tensors=True, model_to_load=model)
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: one tensor
    assert parsed["tensors"].keys() == expected.keys()
    differing = [k for k in expected if not torch.equal(parsed["tensors"][k], expected[k])]
    assert not differing, f"weights changed by the round trip: {differing[:5]}"
    config = model.config.to_dict()
    assert {k: config[k] for k in parsed["config"] if k in config} == {
        k: v for k, v in parsed["config"].items() if k in config
    }


def _sample_and_compare(model: Any, gguf_path: Path, prompt: list[int], label: str) -> list[int]:
    """Generate with llama.cpp over `gguf_path` (f32 KV cache), recompute each sampled token's log-prob with torch;
    the mean and max absolute differences, printed and checked."""
    started = time.perf_counter()
    engine = LlamaEngine(gguf_path, n_ctx=1024, n_threads=2, kv_cache_type="f32")
    loaded_s = time.perf_counter() - started
    started = time.perf_counter()
    gen = engine.generate(prompt, SamplingParams(max_tokens=GENERATED, temperature=1.0, seed=3))
    generate_s = time.perf_counter() - started
    engine.llama.close()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen.token_ids])).logits[0]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(gen.token_ids))
    expected = log_probs[positions, torch.tensor(gen.token_ids)].numpy()
    difference = np.abs(np.asarray(gen.log_probs) - expected)
    print(
        f"\n{label}: {len(gen.token_ids)} tokens after a {len(prompt)}-token prompt; |llama.cpp - torch| log-prob "
        f"mean {difference.mean():.2e}, max {difference.max():.2e} (engine load {loaded_s:.2f} s, "
        f"generation {generate_s:.2f} s)"
    )
    assert len(gen.token_ids) >= 16, gen.text
    assert difference.mean() < 1e-4 and difference.max() < 1e-3, (label, difference.mean(), difference.max())
    return gen.token_ids


def test_llama_cpp_log_probs_are_the_trainers_before_and_after_a_weight_change(
    policy: tuple[Any, Any], written: Path, tmp_path: Path
) -> None:
    model, hf_tokenizer = policy
    prompt = hf_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=True)["input_ids"]
    ours = Tokenizer.from_gguf(written)
    assert prompt == ours.encode(ours.chat_template.render(CONVERSATION, add_generation_prompt=True))
    assert len(prompt) > 200
    pristine = _sample_and_compare(model, written, prompt, "pristine weights")

    stepped = copy.deepcopy(model)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in stepped.parameters():  # a step's worth of change on every weight (tied ones once)
            parameter.add_(torch.randn(parameter.shape, generator=noise) * 1e-3)
    out = tmp_path / "stepped.gguf"
    started = time.perf_counter()
    write_policy_gguf(stepped, default_gguf(), out)
    print(f"\nwrite_policy_gguf: {time.perf_counter() - started:.2f} s (source metadata cached)")
    perturbed = _sample_and_compare(stepped, out, prompt, "perturbed weights")
    assert perturbed != pristine  # same seed, new weights: the reload took
