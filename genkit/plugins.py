"""The plugin registry: one pluggy manager, four kinds of item, origins recorded.

Built-ins (``builtin_strategies``) register through the same hooks as pip-installed packs
(entry-point group ``genkit``). Loading a pack is error-isolated: a pack that fails is logged with
its name and skipped unless ``GENKIT_STRICT_PLUGINS=1``. ``GENKIT_PLUGINS=a,b`` loads only those
packs; ``GENKIT_DISABLE_PLUGIN_AUTOLOAD=1`` loads none.

This module does not import torch: items may be given as ``"module:attr"`` strings that are
imported on first use.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .errors import ConfigError, PluginError, UnknownItemError

logger = logging.getLogger("genkit.plugins")

ENTRY_POINT_GROUP = "genkit"
KINDS = ("strategy", "logits_processor", "candidate_generator", "streamer")


@dataclass(frozen=True)
class Origin:
    """Where a registered item came from."""

    plugin: str
    kind: str = "builtin"  # "builtin" | "pack" | "recipe" | "runtime"
    distribution: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        if self.kind == "builtin":
            return f"built-in ({self.plugin})"
        if self.distribution:
            return f"{self.distribution}@{self.version} ({self.plugin})"
        return f"{self.kind} {self.plugin}"


def resolve(ref: Any) -> Any:
    """Return ``ref`` itself, or the object named by a ``"module:attr"`` string."""
    if isinstance(ref, str) and ":" in ref:
        module_name, _, attr = ref.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    return ref


@dataclass(frozen=True)
class FieldSpec:
    """A ``GenerationConfig`` field that a plugin owns.

    ``check(value) -> bool`` tells whether a value is acceptable; ``accepted`` describes the
    accepted values in words and appears in the error message.
    """

    name: str
    default: Any = None
    check: Callable[[Any], bool] | None = None
    accepted: str = ""
    doc: str = ""

    def validate(self, value: Any) -> None:
        if value is None or value == self.default or self.check is None:
            return
        try:
            ok = bool(self.check(value))
        except Exception:  # a check that cannot even look at the value rejects it
            ok = False
        if not ok:
            raise ConfigError(
                f"`{self.name}` must be {self.accepted or 'a valid value'}; got {value!r}."
            )


@dataclass
class Item:
    name: str
    kind: str
    target: Any  # callable or "module:attr"
    origin: Origin
    description: str = ""
    _resolved: Any = field(default=None, repr=False)

    def load(self) -> Any:
        if self._resolved is None:
            self._resolved = resolve(self.target)
        return self._resolved


@dataclass
class StrategyItem(Item):
    applies: Any = None  # callable(config) -> bool, or "module:attr", or None
    priority: int = 0

    def matches(self, config: Any) -> bool:
        if self.applies is None:
            return False
        return bool(resolve(self.applies)(config))


@dataclass
class ProcessorItem(Item):
    fields: tuple[FieldSpec, ...] = ()
    order: int = 0


class Registry:
    """All registered items, by kind and name."""

    def __init__(self) -> None:
        self.items: dict[str, dict[str, Item]] = {k: {} for k in KINDS}
        self.fields: dict[str, tuple[FieldSpec, Origin]] = {}
        self.plugins: dict[str, dict[str, Any]] = {}  # plugin name -> info (distribution, version, hooks, items)
        self.failed: dict[str, str] = {}  # plugin name -> error text

    # -- adding ---------------------------------------------------------------------------
    def add(self, item: Item) -> None:
        table = self.items[item.kind]
        if item.name in table:
            other = table[item.name]
            raise PluginError(
                f"duplicate {item.kind.replace('_', ' ')} name {item.name!r}: registered by "
                f"{other.origin} and by {item.origin}"
            )
        if isinstance(item, ProcessorItem):
            for spec in item.fields:
                if spec.name in self.fields:
                    prev_spec, prev_origin = self.fields[spec.name]
                    if prev_origin != item.origin:
                        raise PluginError(
                            f"duplicate GenerationConfig field {spec.name!r}: declared by "
                            f"{prev_origin} and by {item.origin}"
                        )
            for spec in item.fields:
                self.fields[spec.name] = (spec, item.origin)
        table[item.name] = item
        info = self.plugins.setdefault(item.origin.plugin, _plugin_info(item.origin))
        info["items"].setdefault(item.kind, []).append(item.name)

    def register_function(self, kind: str, origin: Origin) -> Callable[..., None]:
        def _check_name(name: Any) -> None:
            if not isinstance(name, str) or not name:
                raise PluginError(f"{origin}: a {kind} name must be a non-empty string, got {name!r}")

        if kind == "strategy":

            def register(name: str, decode: Any, *, applies: Any = None, priority: int = 0,
                         description: str = "") -> None:
                _check_name(name)
                self.add(StrategyItem(name, kind, decode, origin, description, applies=applies,
                                      priority=priority))
        elif kind == "logits_processor":

            def register(name: str, factory: Any, *, fields: Sequence[FieldSpec] = (), order: int = 0,
                         description: str = "") -> None:
                _check_name(name)
                self.add(ProcessorItem(name, kind, factory, origin, description, fields=tuple(fields),
                                       order=order))
        else:

            def register(name: str, factory: Any, *, description: str = "") -> None:  # type: ignore[misc]
                _check_name(name)
                self.add(Item(name, kind, factory, origin, description))

        return register

    # -- reading --------------------------------------------------------------------------
    def get(self, kind: str, name: str) -> Item:
        try:
            return self.items[kind][name]
        except KeyError:
            known = ", ".join(sorted(self.items[kind])) or "none"
            raise UnknownItemError(
                f"unknown {kind.replace('_', ' ')} {name!r}; registered: {known}"
            ) from None

    def strategies(self) -> list[StrategyItem]:
        return sorted(self.items["strategy"].values(), key=lambda s: -s.priority)  # type: ignore[arg-type]

    def processors(self) -> list[ProcessorItem]:
        return sorted(self.items["logits_processor"].values(), key=lambda p: p.order)  # type: ignore[arg-type]

    def select_strategy(self, config: Any) -> StrategyItem:
        for item in self.strategies():
            if item.matches(config):
                return item
        raise ConfigError("no registered strategy applies to this generation config")


def _plugin_info(origin: Origin) -> dict[str, Any]:
    return {"name": origin.plugin, "kind": origin.kind, "distribution": origin.distribution,
            "version": origin.version, "hooks": [], "items": {}}


_HOOKS = {
    "register_strategies": "strategy",
    "register_logits_processors": "logits_processor",
    "register_candidate_generators": "candidate_generator",
    "register_streamers": "streamer",
}


def _call_hooks(pm: pluggy.PluginManager, registry: Registry, plugin: Any, origin: Origin) -> None:
    """Call each hook of one plugin with a ``register`` bound to that plugin's origin."""
    info = registry.plugins.setdefault(origin.plugin, _plugin_info(origin))
    for hook_name, kind in _HOOKS.items():
        impls = [i for i in getattr(pm.hook, hook_name).get_hookimpls() if i.plugin is plugin]
        for impl in impls:
            if hook_name not in info["hooks"]:
                info["hooks"].append(hook_name)
            impl.function(register=registry.register_function(kind, origin))


def _entry_points() -> list[Any]:
    import importlib_metadata

    return list(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def build_registry(extra_plugins: Iterable[tuple[Any, Origin]] = ()) -> Registry:
    """Create the plugin manager, load built-ins and packs, and collect every registered item."""
    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    loaded: list[tuple[Any, Origin]] = []

    from genkit import builtin_strategies

    pm.register(builtin_strategies, name="builtin")
    loaded.append((builtin_strategies, Origin("builtin", "builtin")))

    strict = _env_flag("GENKIT_STRICT_PLUGINS")
    if not _env_flag("GENKIT_DISABLE_PLUGIN_AUTOLOAD"):
        allow_raw = os.environ.get("GENKIT_PLUGINS")
        allow = None if allow_raw is None else {p.strip() for p in allow_raw.split(",") if p.strip()}
        for ep in _entry_points():
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else None
            if allow is not None and ep.name not in allow and (dist_name or "") not in allow:
                continue
            origin = Origin(ep.name, "pack", dist_name, dist.version if dist is not None else None)
            try:
                mod = ep.load()
                pm.register(mod, name=ep.name)
                loaded.append((mod, origin))
            except Exception as exc:  # error isolation: one broken pack never breaks the rest
                _record_failure(registry, origin, exc, strict)

    for plugin, origin in extra_plugins:
        pm.register(plugin, name=origin.plugin)
        loaded.append((plugin, origin))

    pm.check_pending()
    for plugin, origin in loaded:
        snapshot = {k: dict(v) for k, v in registry.items.items()}, dict(registry.fields)
        try:
            _call_hooks(pm, registry, plugin, origin)
        except Exception as exc:
            if origin.kind == "builtin":
                raise
            # roll back whatever this pack half-registered
            registry.items, registry.fields = snapshot
            registry.plugins.pop(origin.plugin, None)
            _record_failure(registry, origin, exc, strict)
    registry.pm = pm  # type: ignore[attr-defined]
    return registry


def _record_failure(registry: Registry, origin: Origin, exc: BaseException, strict: bool) -> None:
    msg = f"{type(exc).__name__}: {exc}"
    if strict:
        raise PluginError(f"genkit plugin {origin.plugin!r} failed to load: {msg}") from exc
    registry.failed[origin.plugin] = msg
    logger.warning("genkit plugin %r failed to load and was skipped: %s", origin.plugin, msg)


_registry: Registry | None = None
_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                _registry = build_registry()
    return _registry


def reset_registry() -> None:
    """Forget the registry so the next :func:`get_registry` reloads plugins (tests, installs)."""
    global _registry
    with _lock:
        _registry = None


def register_plugin(plugin: Any, name: str) -> None:
    """Register a plugin object (module or class with hookimpls) at run time."""
    reg = get_registry()
    origin = Origin(name, "runtime")
    reg.pm.register(plugin, name=name)  # type: ignore[attr-defined]
    _call_hooks(reg.pm, reg, plugin, origin)  # type: ignore[attr-defined]
