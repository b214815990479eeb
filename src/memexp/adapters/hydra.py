"""Hydra's private APIs that the sweep launcher builds on (hydra_plugins.memexp_launcher):

- `IConfigRepository` (hydra._internal.config_repository): the interface of the config
  repository, which `SharedRepository` wraps with a cache shared by many composes (a sweep's,
  and every `memexp.estimate.compose_config` of a process);
- the config loader's `repository` attribute (hydra._internal.config_loader_impl), where that
  wrapper goes;
- `HydraContext.config_loader`, replaced by a loader that keeps each job's config from the
  sweeper's check of its batch (`Sweeper.validate_batch_is_legal`, which composes every job by
  `config_loader.load_sweep_config`) until the launcher takes it.

Checked on hydra-core 1.3.8. `check()` says what moved, if anything did.
"""

from __future__ import annotations

import copy
import inspect
from importlib.metadata import version

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.config_repository import IConfigRepository
from hydra.core.object_type import ObjectType
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext

__all__ = ["SharedRepository", "check", "wrap_repository", "replace_loader"]


def wrap_repository(loader, wrap) -> None:
    """The loader's config repository becomes `wrap(repository)`."""
    loader.repository = wrap(loader.repository)


class SharedRepository(IConfigRepository):
    """Hydra's config repository for many composes (a sweep's, a plan's candidates): each config
    file is parsed, and each schema copied out of Hydra's ConfigStore, once for them all (in
    `cache`, which loaders may share); each compose gets a copy of its own. Hydra caches them
    only within one compose (CachingConfigRepository), around a deep copy of the whole
    repository, the ConfigStore included: 0.27 s a compose here, 0.15 s with this. A compose
    that sets its own search path (hydra.searchpath) gets a repository and a cache of its
    own."""

    def __init__(self, repository: IConfigRepository, cache: dict | None = None):
        self._repository = repository
        self._cache = {} if cache is None else cache

    def __deepcopy__(self, memo) -> SharedRepository:
        # each compose's CachingConfigRepository copies it, to set a search path on the copy
        return SharedRepository(self._repository, self._cache)

    def __getstate__(self) -> dict:
        return {"_repository": self._repository, "_cache": {}}  # jobs compose nothing

    def initialize_sources(self, config_search_path) -> None:
        self._repository, self._cache = copy.deepcopy(self._repository), {}
        self._repository.initialize_sources(config_search_path)

    def load_config(self, config_path: str):
        if config_path not in self._cache:
            self._cache[config_path] = self._repository.load_config(config_path)
        loaded = copy.copy(self._cache[config_path])
        if loaded is not None:  # a compose changes what it loaded, as Hydra's ConfigStore says
            loaded.config = copy.deepcopy(loaded.config)
        return loaded

    def get_schema_source(self):
        return self._repository.get_schema_source()

    def group_exists(self, config_path: str) -> bool:
        return self._repository.group_exists(config_path)

    def config_exists(self, config_path: str) -> bool:
        return self._repository.config_exists(config_path)

    def get_group_options(self, group_name: str, results_filter=ObjectType.CONFIG) -> list[str]:
        return self._repository.get_group_options(group_name, results_filter)

    def get_sources(self) -> list:
        return self._repository.get_sources()


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
