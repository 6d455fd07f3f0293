"""Reading a GGUF file for import one tensor at a time, in bounded memory.

transformers can load a GGUF file, but only whole: every tensor dequantized to float and held at once (a 14B model in
Q4 -- 8 GB on disk -- takes ~56 GB of RAM that way). Here the file's header is parsed once with the ``gguf``
package's reader, and each tensor is read from the file with plain reads (not through the reader's memory map, whose
touched pages would count against the importing process) and dequantized a slice of rows at a time into the dtype
it will be stored in: written out slice by slice where the family's fix-up leaves the tensor as it is (the
embedding and head, the largest, included), else assembled whole and handed over, one tensor at a time.

The names and the fix-ups are transformers' own, reused rather than copied: the GGUF-to-transformers name map comes
from ``get_gguf_hf_weights_map`` over a model built on the meta device from the GGUF's config (with a MoE file's
particulars: swarm.store.gguf_moe), and the per-family
tensor processors (Llama's q/k row permutation, Gemma's norm offset) from ``TENSOR_PROCESSORS``. So a tensor
imported here equals the one ``from_pretrained(gguf_file=...)`` produces (tests/test_model_import.py compares them on
the built-in model).

By default an import keeps the file's tensors as they are (swarm.store.gguf_blocks writes them): each tensor's
``copy_raw`` copies its bytes from the file, and ``fixup`` says whether transformers' processor still changes it
(asked of the processor itself, as ``_left_as_is`` does); the dequantizing ``read``/``write`` serve an import asked
for a float dtype (``--dtype``).

gguf, torch and transformers are imported inside the functions that need them (the leader reads manifests without
them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.errors import ImportFailed
from swarm.gguf_layout import JOINS, own_processor
from swarm.model_format import GGUF_TYPES
from swarm.store import gguf_moe, gguf_names
from swarm.store.gguf_header import header_field

log = logging.getLogger(__name__)

# Elements dequantized per slice of rows: bounds the float32 intermediates of one tensor (gguf's numpy dequantizers
# make a few arrays of the slice's size) to tens of MB, whatever the tensor's size.
DEQUANT_SLICE_ELEMENTS = 4 << 20

# The plain float types a GGUF may store as they are.
_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

# Bytes copied from the file at a time when its tensors are kept as they are.
COPY_CHUNK_BYTES = 16 << 20


def supported_quant_types() -> list[str]:
    """Names of the GGUF tensor types this import keeps (swarm.model_format.GGUF_TYPES)."""
    return list(GGUF_TYPES)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its transformers name and how to read it."""

    hf_name: str
    shape: tuple[int, ...]
    read: Callable[[Any], Any]  # dtype -> the dequantized, processed torch tensor in that dtype
    # (dtype, binary file) -> writes the tensor's bytes in that dtype slice by slice, never holding it whole; None
    # where the family's fix-up needs the whole tensor (Llama's q/k permutation, norms)
    write: Callable[[Any, Any], None] | None = None
    floating: bool = True
    # the tensor as the file has it: GGUF name and type, the shape of its stored bytes (rows, bytes per row) for a
    # quantized type or its logical shape for a float one, their size, whether transformers' fix-up still applies,
    # and copy_raw(binary file), which copies those bytes from the GGUF a slice at a time
    gguf_name: str = ""
    gguf_type: str = ""
    raw_shape: tuple[int, ...] = ()
    raw_bytes: int = 0
    fixup: bool = False
    copy_raw: Callable[[Any], None] | None = None
    # one of several GGUF tensors that together make one transformers tensor (a MoE layer's ffn_gate_exps and
    # ffn_up_exps: its experts' gate_up_proj), joined along swarm.model_format.GGUF_JOIN_DIM: that tensor's name,
    # and this part's place
    into: str = ""
    part: int = 0
    join: str = ""  # how the parts are joined: side by side, or interleaved (gpt-oss: swarm.gguf_layout)
    # the shape transformers' fix-up gives a vector where it reshapes it (Qwen2-MoE's shared-expert gate: [hidden] to
    # [1, hidden]): what ``read`` returns; () where it is ``shape``
    read_shape: tuple[int, ...] = ()


class GGUFSource:
    """A GGUF file opened for import: its architecture, config, tensor types, and the tensors in transformers'
    names. Nothing is dequantized until a tensor's ``read`` is called."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.reader = _lean_reader_class()(str(self.path))
        except Exception as exc:
            raise ImportFailed(f"cannot read the GGUF file {self.path} ({exc}); the file may be incomplete") from exc
        self.architecture = header_field(self.reader, "general.architecture", str) or "unknown"

    # --- checks made before anything is written ---------------------------------------------------------------------

    def unsupported_types(self) -> dict[str, list[str]]:
        """Tensor type -> tensors of that type this import does not take (empty when every one is taken)."""
        supported = set(supported_quant_types())
        out: dict[str, list[str]] = {}
        for tensor in self.reader.tensors:
            if tensor.tensor_type.name not in supported:
                out.setdefault(tensor.tensor_type.name, []).append(tensor.name)
        return out

    def file_type(self) -> str:
        """The file's quantization as llama.cpp names it ("Q4_K_M", "Q8_0", "F16"), from general.file_type; else the
        type most of its matrices' bytes are in."""
        import gguf

        number = header_field(self.reader, "general.file_type", int)
        if number is not None:
            try:
                name = gguf.LlamaFileType(number).name
            except ValueError:
                name = ""
            if name and name != "GUESSED":
                return name.removeprefix("MOSTLY_").removeprefix("ALL_")
        sizes: dict[str, int] = {}
        for tensor in self.reader.tensors:
            if len(tensor.shape) >= 2:
                sizes[tensor.tensor_type.name] = sizes.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
        return max(sizes, key=sizes.__getitem__) if sizes else ""

    def size_label(self) -> str:
        """The file's own size label ("135M", "8x7B"), where it has one."""
        return header_field(self.reader, "general.size_label", str) or ""

    def stored_dtype(self) -> str:
        """The manifest's dtype: the float type a GPU computes the file's tensors in (a CPU computes in float32), and
        the dtype an import asked for ``--dtype auto`` would once have stored them in: the file's own float type where
        its matrices are plain floats; bfloat16 where they are quantized (bf16 has float32's range, so a model trained
        in bf16 -- Gemma 3 -- cannot overflow on a GPU); float32 only for a file whose matrices are all float32."""
        kinds = {t.tensor_type.name for t in self.reader.tensors if len(t.shape) >= 2}
        if kinds - set(_FLOAT_TYPES):
            return "bfloat16"
        if "BF16" in kinds:
            return "bfloat16"
        if "F16" in kinds:
            return "float16"
        return "float32"

    def config(self) -> Any:
        """The transformers config transformers builds from the file's metadata, with a MoE file's particulars
        (swarm.store.gguf_moe: its expert sizes, Mixtral)."""
        from transformers import AutoConfig

        if gguf_names.owned(self.architecture):  # a family transformers' GGUF loader cannot read
            return gguf_names.config(self.reader, self.architecture)
        try:
            with self._parsed_once():
                config = AutoConfig.from_pretrained(self.path.parent, gguf_file=self.path.name)
        except Exception as exc:
            raise ImportFailed(f"transformers cannot read the GGUF file {self.path}: {exc}") from exc
        # the expert sizes transformers leaves at the class defaults, and Mixtral (a llama file with experts)
        return gguf_moe.moe_config(self.reader, self.architecture, config)

    def tokenizer(self) -> Any:
        """The tokenizer transformers builds from the file's vocabulary (raises what transformers raises)."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if gguf_names.owned(self.architecture):
            # AutoTokenizer asks transformers' GGUF config first, which these families do not have; the tokenizer
            # itself is built from the file's tokenizer.ggml.* fields whatever the architecture
            return PreTrainedTokenizerFast.from_pretrained(self.path.parent, gguf_file=self.path.name)
        with self._parsed_once():
            return AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)

    @contextlib.contextmanager
    def _parsed_once(self):
        """Let transformers' GGUF code use this reader instead of parsing the file again: the parse is slow where
        the vocabulary is large (gguf-py reads array fields element by element; measured here on Gemma 3's 262k
        tokens: ~25 s a parse, and config + tokenizer parse twice more). transformers looks ``gguf.GGUFReader`` up
        at each call, so the name is pointed at this reader for the duration and put back after."""
        import gguf

        original = gguf.GGUFReader
        mine, reader = str(self.path), self.reader

        def reader_for(path, *args, **kwargs):
            if str(path) == mine and not args and not kwargs:
                return reader
            return original(path, *args, **kwargs)

        # the patch: transformers' GGUF loader opens the file through gguf.GGUFReader
        gguf.GGUFReader = reader_for  # type: ignore[misc, assignment]
        try:
            yield
        finally:
            gguf.GGUFReader = original  # type: ignore[misc]  # the patch undone

    # --- tensors -----------------------------------------------------------------------------------------------------

    def tensors(self, config: Any) -> list[GGUFTensor]:
        """Every tensor transformers' model of this config takes, in the file's order, named as transformers names
        them (tensors it has no place for, e.g. llama.cpp's precomputed rope factors, are left out, as
        from_pretrained leaves them out)."""
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        own = own_processor(self.architecture)
        if own is not None:  # swarm's own map and fix-up (swarm.store.gguf_names, swarm.gguf_layout)
            processor: Any = own
            names = gguf_names.weights_map(self.architecture, config)
            joined = gguf_names.joined_parts(self.architecture, config)
        else:
            processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config=config.to_dict())
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)
            names = gguf_moe.weights_map(skeleton, processor, self.architecture)
            del skeleton
            joined = gguf_moe.joined_parts(names)
        join = JOINS.get(self.architecture, "")
        out = []
        for tensor in self.reader.tensors:
            # transformers maps a MoE layer's expert tensors under their names without ".weight" (its processor
            # matches them so)
            hf_name = names.get(tensor.name) or names.get(tensor.name.removesuffix(".weight"))
            if hf_name is None:
                log.info("%s: no place for GGUF tensor %s in a %s model; skipped", self.path.name, tensor.name,
                         config.model_type)
                continue
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            as_is = _left_as_is(processor, tensor.name, shape)
            write = None
            if as_is and len(shape) >= 2:
                write = functools.partial(self._write, tensor, shape)  # write(dtype, out)
            kind = tensor.tensor_type.name
            raw_bytes = int(tensor.n_bytes)
            rows = int(tensor.n_elements) // shape[-1]
            raw_shape = shape if kind in _FLOAT_TYPES else (rows, raw_bytes // rows)
            into, part = "", 0
            stem = tensor.name if tensor.name in joined else gguf_moe.stem(tensor.name)
            if stem in joined:  # a part of a MoE layer's gate_up_proj: named apart, joined where a stage widens it
                into, part = hf_name, joined[stem]
                hf_name = f"{hf_name}.{tensor.name.split('.')[2]}"  # blk.N.<kind>...: the kind
            read_shape = _fixed_shape(processor, tensor.name, shape) if not as_is and len(shape) < 2 else shape
            if own is not None:
                read_shape = own.shape(tensor.name, shape)
            out.append(GGUFTensor(hf_name, shape, functools.partial(self._read, tensor, shape, processor=processor),
                                  write, gguf_name=tensor.name, gguf_type=kind, raw_shape=raw_shape,
                                  raw_bytes=raw_bytes, fixup=not as_is,
                                  copy_raw=functools.partial(self._copy_raw, tensor), into=into, part=part,
                                  join=join if into else "",
                                  read_shape=() if read_shape == shape else read_shape))
        return out

    def _copy_raw(self, tensor: Any, out: Any) -> None:
        """Copy the tensor's bytes, as the file has them, to ``out`` a chunk at a time (plain reads: no page of the
        file's memory map is touched)."""
        with open(self.path, "rb", buffering=0) as f:
            done, size = 0, int(tensor.n_bytes)
            while done < size:
                chunk = os.pread(f.fileno(), min(COPY_CHUNK_BYTES, size - done), tensor.data_offset + done)
                if not chunk:
                    raise ImportFailed(f"{self.path} ends inside tensor {tensor.name}; the file is incomplete")
                out.write(chunk)
                done += len(chunk)

    def _read(self, tensor: Any, shape: tuple[int, ...], dtype: Any, processor: Any) -> Any:
        """Dequantize one tensor slice by slice into ``dtype``, then apply the family's fix-up.

        One-dimensional tensors (norms, biases: small) are fixed up in float32 before rounding, as transformers does
        (Gemma's ``norm - 1`` must not be rounded twice); larger ones are rounded first and then permuted, which
        commutes with rounding -- so the result equals transformers' float32 result rounded to ``dtype``.
        """
        import torch

        work_dtype = torch.float32 if len(shape) < 2 else dtype
        out = torch.empty(shape, dtype=work_dtype)
        flat = out.view(-1, shape[-1]) if len(shape) >= 2 else out.view(1, -1)
        for start, values in self._slices(tensor):
            flat[start : start + values.shape[0]] = values
        result = processor.process(weights=out, name=tensor.name).weights
        return torch.as_tensor(result).to(dtype).contiguous()  # a fix-up may hand back numpy (Qwen2-MoE's)

    def _write(self, tensor: Any, shape: tuple[int, ...], dtype: Any, out: Any) -> None:
        """Write the tensor's bytes in ``dtype`` to ``out`` slice by slice (for tensors the fix-up leaves as is)."""
        import torch

        for _, values in self._slices(tensor):
            out.write(memoryview(values.to(dtype).contiguous().view(-1).view(torch.uint8).numpy()))

    def _slices(self, tensor: Any):
        """(first row, float32 rows) of the tensor, dequantized a slice of rows at a time."""
        import numpy as np
        import torch
        from gguf import dequantize

        raw_rows = tensor.data.shape[0] if tensor.data.ndim >= 2 else 1
        raw_shape = tuple(tensor.data.shape) if tensor.data.ndim >= 2 else (1, *tensor.data.shape)
        if tensor.data.ndim > 2:  # 3-D (stacked experts): rows are the product of the leading axes
            raw_rows = int(np.prod(tensor.data.shape[:-1]))
            raw_shape = (raw_rows, tensor.data.shape[-1])
        row_bytes = tensor.n_bytes // raw_rows
        row_values = int(tensor.n_elements) // raw_rows
        step = max(1, DEQUANT_SLICE_ELEMENTS // max(1, row_values))
        with open(self.path, "rb", buffering=0) as f:
            for start in range(0, raw_rows, step):
                rows = min(step, raw_rows - start)
                raw = np.empty((rows, raw_shape[1]), dtype=tensor.data.dtype)
                # numpy's stubs make an array a buffer for Python 3.12 on only
                view = memoryview(raw).cast("B")  # type: ignore[arg-type]
                got = os.preadv(f.fileno(), [view], tensor.data_offset + start * row_bytes)
                if got != rows * row_bytes:
                    raise ImportFailed(f"{self.path} ends inside tensor {tensor.name}; the file is incomplete")
                values = dequantize(raw, tensor.tensor_type)
                yield start, torch.from_numpy(np.ascontiguousarray(values)).reshape(rows, -1)

    def generation_config(self, config: Any) -> Any:
        from transformers import GenerationConfig

        return GenerationConfig.from_model_config(config)


def widened(tensors: list[GGUFTensor]) -> list[Any]:
    """``tensors`` as an import widening them to a float dtype writes them: each in the shape its ``read`` returns, a
    MoE layer's gate and up experts joined into the gate_up_proj the decoder layer holds."""
    from swarm.store.moe_layout import joined_parts

    return joined_parts([dataclasses.replace(t, shape=t.read_shape) if t.read_shape else t for t in tensors])


def _fixed_shape(processor: Any, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a (small) tensor after the family's fix-up."""
    import numpy as np

    try:
        return tuple(np.shape(processor.process(weights=np.zeros(shape, np.float32), name=name).weights))
    except Exception:  # a fix-up that needs the real values: it keeps the shape, as _read assumes
        return shape


def _left_as_is(processor: Any, name: str, shape: tuple[int, ...]) -> bool:
    """Whether the family's fix-up leaves this tensor as it is -- then it can be written slice by slice, or kept as
    the file has it. Asked of the processor itself with a probe of the tensor's row count (its fix-ups act on rows:
    Llama's q/k permutation; on a vector's values: Gemma's norm offset), so no family's rules are repeated here."""
    import torch

    probe = torch.arange(shape[0], dtype=torch.float32).reshape(shape[0], *([1] if len(shape) >= 2 else []))
    try:
        result = processor.process(weights=probe, name=name).weights
    except Exception:  # a fix-up that needs the real shape: write the tensor whole
        return False
    return isinstance(result, torch.Tensor) and result.shape == probe.shape and torch.equal(result, probe)


def _lean_reader_class() -> type:
    """gguf's GGUFReader, made to keep its header views as plain numpy arrays rather than memmap subclasses.

    The reader holds one view per part of every metadata value -- two per vocabulary entry -- and a memmap view
    carries its own attributes: measured here on Gemma 3's 262k-token vocabulary, 720 MB for the parsed header, 350
    MB with plain views (the mapping itself is the same). Where gguf's private ``_get`` is not the one this was
    written against, the reader is used as it is.
    """
    import inspect

    import numpy as np
    from gguf import GGUFReader

    get = getattr(GGUFReader, "_get", None)
    if get is None or list(inspect.signature(get).parameters) != ["self", "offset", "dtype", "count", "override_order"]:
        return GGUFReader

    class LeanReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain_data")
            if plain is None:
                plain = self._plain_data = self.data.view(np.ndarray)
            count = int(count)
            itemsize = int(np.empty([], dtype=dtype).itemsize)
            arr = plain[offset : offset + itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return LeanReader
