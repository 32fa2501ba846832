"""Conveyor's extension of vLLM's GPU/CPU worker, loaded with ``--worker-extension-cls``.

vLLM resolves ``POST /collective_rpc {"method": name}`` to a method of its worker; this
class adds Conveyor's own, so a weight sync needs no patch of vLLM.

``conveyor_reload_weights(weights_path)`` is vLLM's in-place ``reload_weights`` made right for
every layout the trainer can load. vLLM's layerwise reload processes a layer (for example,
repacks its weight for the CPU GEMM kernels) only when the checkpoint loads that layer. A
layer whose parameter is shared with another one (an output head tied to the input
embedding) is never loaded from the checkpoint, so the processed copy its kernel computes
with stays at the launch values while its parameter holds the new ones. That was the
silent "tied embeddings stop learning" bug.

Invariant: after ``conveyor_reload_weights`` returns, every layer that owns a parameter
shared with another layer has been processed again from the parameter's current values, so
what a layer computes with is what its parameters hold. Whether the served model is the
trainer's is checked from outside by the sync probe (``services.inference.sync_probe``).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

log = logging.getLogger(__name__)


def _modules_sharing_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every (name, module) that directly owns a parameter also owned by another module."""
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = defaultdict(list)
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners[id(param)].append((name, module))
    shared: dict[str, torch.nn.Module] = {}
    for modules in owners.values():
        if len(modules) > 1:
            shared.update(modules)
    return sorted(shared.items())


class ConveyorWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); methods run on every worker."""

    def conveyor_reload_weights(self, weights_path: str) -> list[str]:
        """Reload ``weights_path`` in place, then reprocess layers with shared (tied) parameters.

        Returns the names of the reprocessed layers (``[]`` for an untied model).
        """
        from vllm.config import set_current_vllm_config

        self.reload_weights(weights_path=weights_path)  # vLLM's own reload
        model = self.model_runner.get_model()
        reprocessed = []
        with torch.no_grad(), set_current_vllm_config(self.vllm_config):
            for name, module in _modules_sharing_parameters(model):
                method = getattr(module, "quant_method", None)
                if method is None or not hasattr(method, "process_weights_after_loading"):
                    continue
                method.process_weights_after_loading(module)
                reprocessed.append(name)
        if reprocessed:
            log.info("conveyor reload: reprocessed tied layers %s", reprocessed)
        return reprocessed
