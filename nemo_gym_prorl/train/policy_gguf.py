"""The trainer's policy as a torch model, and back: load a GGUF into a trainable fp32 Hugging Face model, and write
the model's current weights as an unquantized F32 GGUF our llama.cpp server serves.

The written file carries every metadata key of the source GGUF (architecture hyperparameters, tokenizer, chat
template) with ``general.file_type`` set to F32, and tensors named and laid out the way llama.cpp reads them: the
inverse of what transformers does when it loads a GGUF (`transformers/modeling_gguf_pytorch_utils.py`), so writing
a freshly loaded model and loading the file again gives back the same weights bit for bit. For the llama
architecture that means permuting ``attn_q``/``attn_k`` back into llama.cpp's rotary layout
(``convert_hf_to_gguf.py``'s ``LlamaModel.permute``, which transformers' `LlamaTensorProcessor` reverses).
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def load_policy(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The fp32 model (in eval mode) and tokenizer of `gguf`, offline. transformers marks a model it read from a GGUF as quantized
    (it would neither train nor save it), so its dequantized weights are moved into a plain model of the same
    config: trainable, and saved like any other."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    for name, buffer in loaded.named_buffers():  # the rotary frequencies, which no state dict carries
        module, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(module), attribute, buffer)
    model.tie_weights()
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    return model, tokenizer


def write_policy_gguf(model: Any, source_gguf: Path, out: Path) -> None:
    """`model`'s current weights as an F32 GGUF at `out` with `source_gguf`'s metadata; atomic (a temp file in
    `out`'s folder, renamed over `out` once complete). Source tensors the model has no parameter for (none for
    llama) are copied unchanged; the output matrix is written only when the source has one or the model's is not
    tied to the embeddings. The source's metadata is read once per process (parsing its tokenizer takes seconds)."""
    import gguf as gg

    source_gguf, out = Path(source_gguf), Path(out)
    stat = source_gguf.stat()
    source = _read_source(str(source_gguf.resolve()), stat.st_size, stat.st_mtime_ns)
    tensors = dict(_model_tensors(model, source))
    unknown = sorted(set(tensors) - {name for name, _, _ in source.tensors} - {"output.weight"})
    if unknown:
        raise ValueError(f"{source_gguf} has no tensors {unknown[:5]}: is it this model's GGUF?")
    plan: list[tuple[str, _Tensor | tuple[np.ndarray, Any]]] = [
        (name, tensors.pop(name) if name in tensors else (data, kind)) for name, data, kind in source.tensors
    ]
    plan += list(tensors.items())

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    temp = Path(temp_name)
    try:
        writer = gg.GGUFWriter(temp, arch=source.arch, endianess=source.endianess)
        if source.alignment is not None:
            writer.data_alignment = source.alignment
        for key, value, value_type, sub_type in source.fields:
            writer.add_key_value(key, value, value_type, sub_type=sub_type)
        writer.add_file_type(gg.LlamaFileType.ALL_F32)  # replaces the source's
        for name, tensor in plan:
            if isinstance(tensor, _Tensor):
                writer.add_tensor_info(name, tensor.shape, np.dtype(np.float32), 4 * int(np.prod(tensor.shape)))
            else:  # the source's, as it is
                data, kind = tensor
                writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, tensor in plan:
            writer.write_tensor_data(np.ascontiguousarray(tensor.array() if isinstance(tensor, _Tensor) else tensor[0]))
        writer.close()
        os.replace(temp, out)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class _Source:
    """What a written GGUF takes from its source: metadata in order, and each tensor's name, data and type (the
    data a view of the file's memory map, read only when copied)."""

    arch: str
    endianess: Any
    alignment: int | None
    fields: list[tuple[str, Any, Any, Any]]  # key, value, value type, array element type
    tensors: list[tuple[str, np.ndarray, Any]]


@functools.lru_cache(maxsize=4)
def _read_source(path: str, size: int, mtime_ns: int) -> _Source:
    import gguf as gg

    reader = gg.GGUFReader(path)
    fields = []
    for field in reader.fields.values():
        if field.name == gg.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        if field.name == gg.Keys.General.FILE_TYPE:
            continue  # written as F32
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gg.GGUFValueType.ARRAY else None
        fields.append((field.name, field.contents(), value_type, sub_type))
    alignment = reader.fields.get(gg.Keys.General.ALIGNMENT)
    return _Source(
        arch=reader.fields[gg.Keys.General.ARCHITECTURE].contents(),
        endianess=reader.endianess,
        alignment=None if alignment is None else alignment.contents(),
        fields=fields,
        tensors=[(t.name, t.data, t.tensor_type) for t in reader.tensors],
    )


@dataclass
class _Tensor:
    shape: tuple[int, ...]
    array: Callable[[], np.ndarray]


def _permute_for_llama_cpp(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout of a q/k projection (``convert_hf_to_gguf.py``'s ``LlamaModel.permute``): the inverse
    of transformers' ``LlamaTensorProcessor._reverse_permute_weights``."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _tensor_processing(arch: str) -> Callable[[str, np.ndarray, Any], np.ndarray]:
    """What transformers did to each tensor of `arch` when it loaded the GGUF, undone; only for the processors whose
    inverse is known here."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        TensorProcessor,
    )

    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    if processor is TensorProcessor:
        return lambda name, weights, config: weights
    if processor is LlamaTensorProcessor:

        def undo_llama(name: str, weights: np.ndarray, config: Any) -> np.ndarray:
            if ".attn_q." in name:
                return _permute_for_llama_cpp(weights, config.num_attention_heads)
            if ".attn_k." in name:
                return _permute_for_llama_cpp(weights, config.num_key_value_heads)
            return weights

        return undo_llama
    raise NotImplementedError(f"writing a {arch} GGUF: transformers changes its tensors on load ({processor.__name__})")


def _model_tensors(model: Any, source: _Source) -> Iterator[tuple[str, _Tensor]]:
    """(GGUF tensor name, its data when asked) for each tensor of `model` to write."""
    import gguf as gg
    import torch

    arch_id = next((k for k, v in gg.MODEL_ARCH_NAMES.items() if v == source.arch), None)
    if arch_id is None:
        raise NotImplementedError(f"the gguf package knows no architecture {source.arch!r}")
    config = model.config
    names = gg.get_tensor_name_map(arch_id, config.num_hidden_layers)
    undo = _tensor_processing(source.arch)
    output = model.get_output_embeddings()
    tied = output is not None and output.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    skip_output = tied and not any(name == "output.weight" for name, _, _ in source.tensors)
    state = model.state_dict()
    for key, value in state.items():
        stem, _, suffix = key.rpartition(".")
        mapped = names.get_name(stem)
        if mapped is None:
            raise ValueError(f"no GGUF tensor name for the model's {key}")
        if mapped == "output" and skip_output:
            continue
        name = f"{mapped}.{suffix}"

        def array(name: str = name, value: Any = value) -> np.ndarray:
            return undo(name, value.detach().to("cpu", dtype=torch.float32).numpy(), config)

        yield name, _Tensor(tuple(value.shape), array)
