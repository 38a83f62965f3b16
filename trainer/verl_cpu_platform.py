"""A CPU platform for verl 0.9.1, registered through verl's own platform plugin registry, so
verl's real FSDP2 actor worker (world size 1, gloo) runs the tiny model in tests and CI.

verl ships platforms for CUDA, ROCm and NPU only: without an accelerator its auto-detection falls
back to "nvidia" (verl/plugin/platform/platform_manager.py:117), so the worker asks for NCCL
(verl/utils/distributed.py:89) and a "cuda" device mesh (verl/workers/engine/fsdp/utils.py:48).
A worker process loads this module by `VERL_USE_EXTERNAL_MODULES=darl.trainer.verl_cpu_platform`
and picks it by `VERL_PLATFORM=cpu` (verl/__init__.py:49, platform_manager.py:92). What stays
out of reach on CPU even so is listed in trainer/verl_backend.py's docstring.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu"
WORKER_ENV = {"VERL_USE_EXTERNAL_MODULES": __name__, "VERL_PLATFORM": PLATFORM_NAME}


def _zero(*_: Any, **__: Any) -> int:
    return 0


def _nothing(*_: Any, **__: Any) -> None:
    return None


def _device_module() -> types.ModuleType:
    """torch.cpu plus the memory and RNG calls verl makes on `get_torch_device()`."""
    module = types.ModuleType("darl_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(module, name, getattr(torch.cpu, name))
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated"):
        setattr(module, name, _zero)
    module.memory_reserved = _zero
    module.empty_cache = _nothing
    module.reset_peak_memory_stats = _nothing
    module.mem_get_info = lambda *_, **__: (0, 0)
    module.get_device_name = lambda *_, **__: "CPU"
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.get_rng_state = torch.get_rng_state
    module.set_rng_state = torch.set_rng_state
    module.is_available = lambda: True
    return module


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """Tensors stay on the CPU; collectives go through gloo."""

    _module = _device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> Any:
        # verl moves modules with `.to(device=get_device_id())`; an index would mean an accelerator.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "DARL_CPU_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {}

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _register_fsdp_engine() -> None:
    """verl registers its FSDP engine for "cuda" and "npu" only (transformer_impl.py:1143); the
    engine itself is device-agnostic once the platform answers "cpu". Imported only now: the
    engine module asks for the platform when it loads (transformer_impl.py:89)."""
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    register = EngineRegistry.register(
        model_type="language_model", backend=["fsdp", "fsdp2"], device=PLATFORM_NAME
    )
    register(FSDPEngineWithLMHead)


_register_fsdp_engine()
