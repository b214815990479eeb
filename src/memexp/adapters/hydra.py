"""Hydra's private APIs that the sweep launcher builds on (hydra_plugins.memexp_launcher):

- `IConfigRepository` (hydra._internal.config_repository): the interface of the config
  repository, which the launcher wraps with a cache shared by a sweep's composes;
- the config loader's `repository` attribute (hydra._internal.config_loader_impl), where that
  wrapper goes;
- `HydraContext.config_loader`, replaced by a loader that keeps each job's config from the
  sweeper's check of its batch (`Sweeper.validate_batch_is_legal`, which composes every job by
  `config_loader.load_sweep_config`) until the launcher takes it.

Checked on hydra-core 1.3.8. `check()` says what moved, if anything did.
"""

from __future__ import annotations

import inspect
from importlib.metadata import version

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.config_repository import IConfigRepository
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext

__all__ = ["IConfigRepository", "check", "wrap_repository", "replace_loader"]


def wrap_repository(loader, wrap) -> None:
    """The loader's config repository becomes `wrap(repository)`."""
    loader.repository = wrap(loader.repository)


def replace_loader(hydra_context: HydraContext, wrapper: type) -> None:
    """The context's config loader becomes `wrapper(loader)`, once: the sweeper holds the same
    context, and composes each batch with it."""
    if not isinstance(hydra_context.config_loader, wrapper):
        hydra_context.config_loader = wrapper(hydra_context.config_loader)


def check() -> None:
    """Raise, naming what changed, where this Hydra no longer has what memexp builds on."""
    where = f"hydra-core {version('hydra-core')} (memexp was checked on 1.3.8)"
    loader_init = inspect.getsource(ConfigLoaderImpl.__init__)
    if "self.repository" not in loader_init:
        raise RuntimeError(f"{where}: ConfigLoaderImpl no longer keeps its `repository`")
    if list(inspect.signature(ConfigLoaderImpl.load_sweep_config).parameters) != [
            "self", "master_config", "sweep_overrides"]:
        raise RuntimeError(f"{where}: ConfigLoaderImpl.load_sweep_config's signature changed")
    if "config_loader.load_sweep_config" not in inspect.getsource(
            Sweeper.validate_batch_is_legal):
        raise RuntimeError(f"{where}: Sweeper.validate_batch_is_legal no longer composes each "
                           "job with hydra_context.config_loader.load_sweep_config")
    expected = {"config_exists", "get_group_options", "get_schema_source", "get_sources",
                "group_exists", "initialize_sources", "load_config"}
    if IConfigRepository.__abstractmethods__ != expected:
        raise RuntimeError(f"{where}: IConfigRepository's methods changed: "
                           f"{sorted(IConfigRepository.__abstractmethods__ ^ expected)}")
