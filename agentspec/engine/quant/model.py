"""A GGUF model with its weights as the file stores them: the transformers model's linear
layers and embedding replaced by :class:`QuantLinear` and :class:`QuantEmbedding` over
:class:`~agentspec.engine.quant.formats.QuantWeight`, no full-precision copy made.

The model is built on the meta device from its config, its quantized tensors read from the
GGUF (memory-mapped) straight into the native layout, then the few plain tensors (norms,
biases) and the rotary tables are made on the CPU. The weights' values are bitwise gguf's own
dequantisation of them, the values transformers' GGUF loader gives the float32 model; the
products differ from the float32 path in their inputs, each row quantized alone to 16 bits a
group, and their order of summation (the same for every row and every row count: ``qmm.cpp``).
Each weight is moved into one arena of huge pages as it is read (:func:`keep`).

A float checkpoint quantized at load (:mod:`~agentspec.engine.quant.quantize`) is held in the
same modules, and so runs the same way.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from agentspec.engine import pages
from agentspec.engine.quant.formats import FORMATS, QuantWeight
from agentspec.engine.quant.tiles import TileWeight


class QuantLinear(torch.nn.Module):
    """A linear layer over a :class:`QuantWeight` (float32 in and out; on a GPU a
    :class:`~agentspec.engine.quant.tiles.TileWeight`, the fused forward's, in its dtype)."""

    def __init__(self, weight: QuantWeight | TileWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.k, weight.n
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qweight.matmul(x, self.bias).to(x.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The whole weight dequantised (``[out, in]`` float32), made anew on each call: for
        what reads a weight outside a forward (a draft head's training), never a forward."""
        return self.qweight.dequantized()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.qweight.kind}")


class QuantEmbedding(torch.nn.Module):
    """An embedding table held as a :class:`QuantWeight` (or a
    :class:`~agentspec.engine.quant.tiles.TileWeight`): a lookup dequantises its rows."""

    def __init__(self, weight: QuantWeight | TileWeight) -> None:
        super().__init__()
        self.qweight = weight
        self.num_embeddings, self.embedding_dim = weight.n, weight.k

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantised (see :attr:`QuantLinear.weight`)."""
        return self.qweight.dequantized()


def _permute_order(n: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's interleaving of a query or key projection's rotary
    halves (what transformers' GGUF loader does to the float32 weights)."""
    dim = n // heads // 2
    return np.arange(n).reshape(heads, dim, 2).transpose(0, 2, 1).reshape(-1)


HELD_ARCHITECTURES = ("llama", "qwen2", "qwen3")
"""The GGUF architectures whose tensors load as stored: transformers' GGUF loader changes no
value of theirs but the rotary interleaving of Llama's query and key rows, which is a row
order (Gemma's norms, for one, are stored offset by one and rewritten by the loader)."""


@functools.lru_cache(maxsize=2)
def _read(path: str, size: int, mtime: int) -> Any:
    """The file's reader (memory-mapped), parsed once for the check and the load that follows
    (its vocabulary alone takes seconds to parse)."""
    import gguf

    return gguf.GGUFReader(path)


def loads_as_stored(path: Path) -> bool:
    """Whether the GGUF file ``path`` loads as stored: an architecture of
    :data:`HELD_ARCHITECTURES` whose matrices are all of held types (a file with float16 or
    float32 matrices, as small or converted models have, does not)."""
    file = _File(path)
    return file.arch in HELD_ARCHITECTURES and all(
        t.tensor_type.name in FORMATS for t in file.tensors.values() if len(t.shape) > 1)


def default_as_stored(path: Path) -> bool:
    """Whether the GGUF file ``path`` loads as stored when no dtype is named (on the CPU): where
    it can (:func:`loads_as_stored`) and the native kernels build here with vectors (AVX-512,
    AVX2 or ARM's NEON, ``native.lanes``). Without vectors the file's weights run many times
    slower than the dequantised model's modules, so there the default is the float32 model,
    unless its copy would take more than half the memory available (then the weights as
    stored: slow, but loaded); either way a warning says so once."""
    from agentspec.engine.quant import native
    from agentspec.errors import warn_once

    if not loads_as_stored(path) or not native.available():
        return False
    if native.lanes():
        return True
    need = 4 * sum(int(t.n_elements) for t in _File(path).tensors.values())
    free = _available_memory()
    if free is not None and need > free / 2:
        warn_once(f"{path.name}: the native kernels have no vectors on this processor (no "
                  f"AVX-512, AVX2 or NEON), so its weights as stored run slowly; dequantised they "
                  f"would take {need / 2**30:.1f} GiB of {free / 2**30:.1f} GiB available, so "
                  "they load as stored")
        return True
    warn_once(f"{path.name}: the native kernels have no vectors on this processor (no "
              "AVX-512, AVX2 or NEON), so it loads dequantised to float32, which runs faster here; "
              "dtype='gguf' holds the file's own bytes instead")
    return False


def _available_memory() -> int | None:
    """The bytes the kernel says are available (Linux's MemAvailable), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _File:
    """A GGUF file's tensors by name (memory-mapped)."""

    def __init__(self, path: Path) -> None:
        stat = path.stat()
        self.reader = _read(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        self.tensors = {t.name: t for t in self.reader.tensors}
        arch = self.reader.fields["general.architecture"]
        self.arch = bytes(arch.parts[arch.data[0]]).decode()
        self.path = path

    def _tensor(self, name: str) -> Any:
        t = self.tensors.get(name)
        if t is None:
            raise ValueError(f"{self.path.name}: no tensor {name} in the file")
        return t

    def _blocks(self, name: str, heads: int | None) -> tuple[str, Any, int, int, Any]:
        """A quantized tensor's type, blocks, rows, inputs and row order (None: as stored;
        a query or key projection's rotary halves put back as transformers' loader does)."""
        t = self._tensor(name)
        kind = t.tensor_type.name
        if kind not in FORMATS:
            raise ValueError(f"{self.path.name}: tensor {name} is {kind}, which is not held as "
                             f"stored (held: {', '.join(FORMATS)}); load the model with "
                             "dtype='float32' or 'bfloat16'")
        k, n = int(t.shape[0]), int(t.shape[1])
        return kind, t.data, n, k, None if heads is None else _permute_order(n, heads)

    def quantized(self, name: str, *, heads: int | None = None) -> QuantWeight:
        return QuantWeight.of_blocks(*self._blocks(name, heads))

    def tiles(self, name: str, device: torch.device, dtype: torch.dtype, *,
              heads: int | None = None) -> TileWeight:
        """The tensor as the fused forward holds it on ``device`` (:mod:`.tiles`)."""
        return TileWeight.of_blocks(*self._blocks(name, heads), device=device, dtype=dtype)

    def dense(self, name: str) -> torch.Tensor:
        from gguf import quants

        t = self._tensor(name)
        values = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        return torch.from_numpy(values.reshape([int(d) for d in reversed(t.shape)]).copy())


def set_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put ``module`` at ``name`` (dotted) in ``root``, in place of what was there."""
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def load_quantized(path: Path, config: Any, device: str = "cpu",
                   tiles: bool | None = None) -> Any:
    """The causal LM of ``config`` on ``device`` with the GGUF ``path``'s weights held as
    stored: for the CPU's native products as :class:`QuantWeight`, the other parameters
    float32; with ``tiles`` (default: on a GPU) as
    :class:`~agentspec.engine.quant.tiles.TileWeight` for the fused forward, the other
    parameters bfloat16 (the norms and biases of the bfloat16 model).

    Raises:
        ValueError: a tensor in a type not held as stored, a layer with no tensor in the file,
            or an architecture whose GGUF names are unknown (each message names it).
    """
    import gguf
    from transformers import AutoModelForCausalLM

    from agentspec.engine import compat

    file = _File(path)
    _read.cache_clear()  # the file's mapping goes with this load: its pages are not held after
    if file.arch not in HELD_ARCHITECTURES:
        raise ValueError(f"{path.name}: GGUF architecture {file.arch!r} does not load as stored "
                         f"(held: {', '.join(HELD_ARCHITECTURES)}); load it with "
                         "dtype='float32' or 'bfloat16'")
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == file.arch), None)
    if arch is None:
        raise ValueError(f"{path.name}: GGUF architecture {file.arch!r} has no tensor names "
                         "agentspec knows")
    layers = int(config.num_hidden_layers)
    names = gguf.get_tensor_name_map(arch, layers)
    as_tiles = torch.device(device).type != "cpu" if tiles is None else tiles
    dtype = torch.bfloat16 if as_tiles else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    embed_name = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    out_name = next((n for n, m in linears if m is model.get_output_embeddings()), None)

    def gguf_name(hf: str) -> str:
        found = names.get_name(hf)
        if found is None:
            raise ValueError(f"{path.name}: no GGUF tensor name for layer {hf!r} ({file.arch})")
        return found

    arena = pages.Arena()  # each weight moved in as it is read: the peak is one weight over

    def held(key: str, heads: int | None = None) -> QuantWeight | TileWeight:
        if as_tiles:
            return file.tiles(key, torch.device(device), dtype, heads=heads)
        return keep(file.quantized(key, heads=heads), arena)

    with torch.inference_mode(False), torch.no_grad():
        embed = QuantEmbedding(held(gguf_name(embed_name) + ".weight"))
        set_module(model, embed_name, embed)
        for name, module in tqdm(linears, desc=f"loading {path.name}", unit="layer",
                                 disable=len(linears) < 64, leave=False):
            key = gguf_name(name)
            if name == out_name and key + ".weight" not in file.tensors:
                weight = embed.qweight  # tied to the embedding: the one table, held once
            else:
                order = None
                if file.arch == "llama" and key.endswith(".attn_q"):
                    order = heads
                elif file.arch == "llama" and key.endswith(".attn_k"):
                    order = kv_heads
                weight = held(key + ".weight", order)
            bias = None
            if module.bias is not None:
                bias = file.dense(key + ".bias").to(device, dtype)
            set_module(model, name, QuantLinear(weight, bias))
        model.to_empty(device=device)
        for name, param in model.named_parameters():
            if name.endswith(".bias") and isinstance(model.get_submodule(name.rpartition(".")[0]),
                                                     QuantLinear):
                continue
            module_name, _, leaf = name.rpartition(".")
            key = f"{gguf_name(module_name)}.{leaf}"
            if key not in file.tensors:
                raise ValueError(f"{path.name}: no tensor {key} for {name}")
            param.copy_(file.dense(key).reshape(param.shape))
        # The class as save_pretrained writes it: the config, and so the fingerprint (memory
        # rows, heads), is the dequantised model's.
        model.config.architectures = [type(model).__name__]
        base = compat.base_model(model)
        rotary = getattr(base, "rotary_emb", None)
        if rotary is not None:
            base.rotary_emb = type(rotary)(config=model.config).to(device)
    return model.eval()


def keep(weight: QuantWeight, arena: pages.Arena) -> QuantWeight:
    """``weight`` with its arrays moved into ``arena``, as it is made (a loader keeps each
    weight once, in the order its forward reads them): a forward streams all its weights, and
    in a few 2 MiB pages, not thousands of 4 KiB ones over the heap, they cost far fewer TLB
    misses. The values are unchanged."""
    weight.q, weight.scale, weight.offset = (arena.take(t) for t in
                                             (weight.q, weight.scale, weight.offset))
    return weight


AT_LOAD = ("int8", "int4")
"""The kinds of the weights quantized at load (:mod:`~agentspec.engine.quant.quantize`'s
schemes), as :func:`weights_mode` reports them."""


def holds_quantized(model: Any) -> bool:
    """Whether ``model``'s weights are held quantized (any :class:`QuantLinear`): as a GGUF
    stores them, or quantized at load (:mod:`~agentspec.engine.quant.quantize`)."""
    return any(isinstance(m, QuantLinear) for m in model.modules())


def weights_mode(model: Any) -> str:
    """How ``model``'s weights are held: ``"int8"`` or ``"int4"`` (quantized at load, every
    quantized weight by that scheme), ``"bfloat16"`` (held in bfloat16 tables, or bfloat16
    parameters), ``"gguf"`` (as the file stores them), else its parameters' dtype
    (``"float32"``, ``"float16"``). Outputs are a function of the request for one mode; the
    cost model and the bench's reports are kept per mode."""
    if holds_quantized(model):
        kinds = {w.kind for m in model.modules()
                 if isinstance(w := getattr(m, "qweight", None), (QuantWeight, TileWeight))}
        if kinds == {"bf16"}:
            return "bfloat16"
        return kinds.pop() if len(kinds) == 1 and kinds <= set(AT_LOAD) else "gguf"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def weight_bytes(model: Any) -> int:
    """Bytes of weights ``model`` holds: quantized tables once each, plus its parameters."""
    seen: dict[int, int] = {}
    for module in model.modules():
        weight = getattr(module, "qweight", None)
        if isinstance(weight, QuantWeight):
            seen[id(weight)] = weight.nbytes
        elif isinstance(weight, TileWeight):  # a stacked weight's views: its memory, once
            seen[weight.codes.untyped_storage().data_ptr()] = sum(
                t.untyped_storage().nbytes() for t in (weight.codes, weight.scale, weight.offset)
                if t is not None)
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return sum(seen.values()) + dense
