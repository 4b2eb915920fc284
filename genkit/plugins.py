"""The plugin registry: one pluggy manager, six kinds of item, origins recorded.

Built-ins (``builtin_strategies``) register through the same hooks as pip-installed packs
(entry-point group ``genkit``). Each hook is called once, through the plugin manager
(``pm.hook.register_strategies(register=...)``), so pluggy's ``tryfirst``/``trylast``, hook
wrappers and call monitoring apply; ``register`` records the plugin whose implementation is
running as the item's origin. Loading a pack is error-isolated: a pack that fails is logged with
its name and skipped unless ``GENKIT_STRICT_PLUGINS=1``. ``GENKIT_PLUGINS=a,b`` loads only those
packs; ``GENKIT_DISABLE_PLUGIN_AUTOLOAD=1`` loads none.

This module does not import torch: items may be given as ``"module:attr"`` strings that are
imported on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .errors import ConfigError, PluginError, UnknownItemError

logger = logging.getLogger("genkit.plugins")

ENTRY_POINT_GROUP = "genkit"
BUILTIN_PLUGIN = "genkit.builtin_strategies"  # the module of the built-in plugin


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
    accepted values in words and appears in the error message. ``coerce(value) -> value``, when
    given, turns a value as it is written in ``generation_config.json`` (e.g. a dict) into the
    object the field holds, when the field is set; it may raise ``ConfigError`` naming the field.
    ``off_when_none=True`` (a logits processor's switch): an explicit ``None`` passed to
    ``generate`` turns the processor off, as in transformers 5 (``top_k=None`` samples without
    top-k), instead of meaning the default. ``token_ids(value) -> iterable of ints``, when given,
    lists the token ids a (valid) value holds: ``generate`` refuses a value holding an id outside
    the model's vocabulary with a ``ConfigError`` naming the field
    (:func:`genkit.config.checks.check_vocabulary`).
    """

    name: str
    default: Any = None
    check: Callable[[Any], bool] | None = None
    accepted: str = ""
    doc: str = ""
    coerce: Callable[[Any], Any] | None = None
    off_when_none: bool = False
    token_ids: Callable[[Any], Iterable[Any]] | None = None

    def validate(self, value: Any) -> None:
        if value is None or self.check is None or (type(value) is type(self.default) and value == self.default):
            return  # (the type too: True == 1 and 20.0 == 20, but neither is an int count)
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
    """A registered item. ``fields`` are ``GenerationConfig`` fields it owns (any kind may declare
    them: a strategy's knobs, a processor's switches)."""

    name: str
    kind: str
    target: Any  # callable or "module:attr"
    origin: Origin
    description: str = ""
    fields: tuple[FieldSpec, ...] = ()
    _resolved: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.fields = tuple(self.fields)
        bad = [f for f in self.fields if not isinstance(f, FieldSpec)]
        if bad:
            raise PluginError(f"{self.origin}: the fields of {self.kind.replace('_', ' ')} {self.name!r} must be "
                              f"genkit.FieldSpec instances; got {bad[0]!r}")

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
    order: int = 0


@dataclass(frozen=True)
class Kind:
    """A kind of registered item: the hook that registers it and the item class whose fields
    are the keyword options of ``register(name, target, **options)``. Adding a hook is one
    hookspec in :mod:`genkit.hookspecs` plus one entry in :data:`KIND_TABLE`."""

    name: str
    hook: str
    item: type[Item]


KIND_TABLE: tuple[Kind, ...] = (
    Kind("strategy", "register_strategies", StrategyItem),
    Kind("logits_processor", "register_logits_processors", ProcessorItem),
    Kind("candidate_generator", "register_candidate_generators", Item),
    Kind("streamer", "register_streamers", Item),
    Kind("watermark", "register_watermarks", Item),
    Kind("scheduler", "register_schedulers", Item),
)
KINDS = tuple(k.name for k in KIND_TABLE)

# the plugin whose hook implementation is running (set around each call by build_registry)
_current_origin: ContextVar[Origin | None] = ContextVar("genkit_plugin_origin", default=None)


_serials = itertools.count()


class Registry:
    """All registered items, by kind and name."""

    def __init__(self, strict: bool = False) -> None:
        self.items: dict[str, dict[str, Item]] = {k: {} for k in KINDS}
        self.fields: dict[str, tuple[FieldSpec, Origin]] = {}
        self.plugins: dict[str, dict[str, Any]] = {}  # plugin name -> info (distribution, version, hooks, items)
        self.failed: dict[str, str] = {}  # plugin name -> error text
        self.strict = strict
        self.pm: pluggy.PluginManager | None = None
        # what this registry holds, as a key that changes whenever its items or fields do (for the
        # tables derived from it, e.g. genkit.config.fields.field_table)
        self.serial, self.version = next(_serials), 0

    # -- adding ---------------------------------------------------------------------------
    def add(self, item: Item) -> None:
        table = self.items[item.kind]
        other = table.get(item.name)
        if other is not None:
            if other.origin.kind != "builtin" and item.origin.kind == "builtin":
                # a pack ran first and took a built-in name: the pack is the one that fails
                self.fail(other.origin, _duplicate(item, other))
            else:
                raise _duplicate(other, item)
        for spec in item.fields:
            prev = self.fields.get(spec.name)
            if prev is not None and prev[1] != item.origin:
                raise PluginError(f"duplicate GenerationConfig field {spec.name!r}: declared by {prev[1]} and by "
                                  f"{item.origin}")
        for spec in item.fields:
            self.fields[spec.name] = (spec, item.origin)
        table[item.name] = item
        self.version += 1
        info = self.plugins.setdefault(item.origin.plugin, _plugin_info(item.origin))
        info["items"].setdefault(item.kind, []).append(item.name)

    def register_function(self, kind: Kind, origin: Origin | None = None) -> Callable[..., None]:
        """The ``register`` callable a hook receives: ``register(name, target, **options)`` where the
        options are the fields of the kind's item class (``description``, ``fields``, ...). The
        item's origin is the plugin whose hook implementation is running."""
        options = sorted(f.name for f in dataclasses.fields(kind.item)
                         if f.name not in {"name", "kind", "target", "origin"} and not f.name.startswith("_"))

        def register(name: str, target: Any, **kwargs: Any) -> None:
            where = origin or _current_origin.get() or Origin("unknown", "runtime")
            if not isinstance(name, str) or not name:
                raise PluginError(f"{where}: a {kind.name} name must be a non-empty string, got {name!r}")
            unknown = sorted(set(kwargs) - set(options))
            if unknown:
                raise PluginError(f"{where}: register() for a {kind.name.replace('_', ' ')} takes the options "
                                  f"{', '.join(options)}; got {', '.join(unknown)}")
            self.add(kind.item(name=name, kind=kind.name, target=target, origin=where, **kwargs))

        register.__doc__ = f"register(name, target, *, {', '.join(options)})"
        return register

    def fail(self, origin: Origin, exc: BaseException) -> None:
        """A pack failed: forget everything it registered and record the error (fatal with
        ``GENKIT_STRICT_PLUGINS=1``)."""
        for table in self.items.values():
            for name in [n for n, it in table.items() if it.origin.plugin == origin.plugin]:
                del table[name]
        self.fields = {k: v for k, v in self.fields.items() if v[1].plugin != origin.plugin}
        self.version += 1
        self.plugins.pop(origin.plugin, None)
        _record_failure(self, origin, exc, self.strict)

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
        return sorted(self.items["strategy"].values(), key=lambda s: -s.priority)  # type: ignore[arg-type, union-attr]

    def processors(self) -> list[ProcessorItem]:
        return sorted(self.items["logits_processor"].values(), key=lambda p: p.order)  # type: ignore[arg-type, union-attr]

    def select_strategy(self, config: Any) -> StrategyItem:
        """The strategy whose selector applies, with the highest priority. Two that apply with the
        same priority are an error naming both (there are no ties)."""
        chosen: StrategyItem | None = None
        for item in self.strategies():
            if chosen is not None and item.priority < chosen.priority:
                break
            if item.matches(config):
                if chosen is not None:
                    raise PluginError(
                        f"strategy selection is ambiguous: {chosen.name!r} ({chosen.origin}) and {item.name!r} "
                        f"({item.origin}) both apply to this generation config with priority {item.priority}; "
                        "give one of them a different priority, or name the strategy with custom_generate=")
                chosen = item
        if chosen is None:
            raise ConfigError("no registered strategy applies to this generation config")
        return chosen


def _duplicate(first: Item, second: Item) -> PluginError:
    return PluginError(f"duplicate {first.kind.replace('_', ' ')} name {first.name!r}: registered by "
                       f"{first.origin} and by {second.origin}")


def _plugin_info(origin: Origin) -> dict[str, Any]:
    return {"name": origin.plugin, "kind": origin.kind, "distribution": origin.distribution,
            "version": origin.version, "hooks": [], "items": {}}


def _attach(pm: pluggy.PluginManager, registry: Registry, plugin: Any, origin: Origin) -> None:
    """After ``pm.register(plugin)``: record which hooks it implements, and run each of its hook
    implementations with its origin set (so ``register`` knows who calls it) and its errors
    isolated (a failing pack is rolled back and skipped; a built-in's error propagates)."""
    info = registry.plugins.setdefault(origin.plugin, _plugin_info(origin))
    for kind in KIND_TABLE:
        for impl in getattr(pm.hook, kind.hook).get_hookimpls():
            if impl.plugin is not plugin:
                continue
            if kind.hook not in info["hooks"]:
                info["hooks"].append(kind.hook)
            wrapper = impl.hookwrapper or getattr(impl, "wrapper", False)
            impl.function = (_guard_wrapper if wrapper else _guard)(impl.function, origin, registry)


def _guard(fn: Callable[..., Any], origin: Origin, registry: Registry) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        if origin.plugin in registry.failed:
            return None
        token = _current_origin.set(origin)
        try:
            return fn(*args)
        except Exception as exc:
            if origin.kind == "builtin":
                raise
            registry.fail(origin, exc)
            return None
        finally:
            _current_origin.reset(token)

    return call


def _guard_wrapper(fn: Callable[..., Any], origin: Origin, registry: Registry) -> Callable[..., Any]:
    """A hook wrapper (a generator) run with its origin set around each of its steps."""

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        inner = fn(*args)
        step: Callable[[], Any] = inner.__next__
        while True:
            token = _current_origin.set(origin)
            try:
                sent = step()
            except StopIteration as stop:
                return stop.value
            finally:
                _current_origin.reset(token)
            try:
                value = yield sent
            except BaseException as exc:  # pluggy throws a hook's error into new-style wrappers
                step = functools.partial(inner.throw, exc)
            else:
                step = functools.partial(inner.send, value)

    return call


def _entry_points() -> list[Any]:
    import importlib_metadata

    return list(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _load_packs(registry: Registry) -> list[tuple[Any, Origin]]:
    """Import the installed packs (``GENKIT_PLUGINS`` / ``GENKIT_DISABLE_PLUGIN_AUTOLOAD`` honoured);
    one that fails to import is recorded and skipped."""
    if _env_flag("GENKIT_DISABLE_PLUGIN_AUTOLOAD"):
        return []
    allow_raw = os.environ.get("GENKIT_PLUGINS")
    allow = None if allow_raw is None else {p.strip() for p in allow_raw.split(",") if p.strip()}
    loaded = []
    for ep in _entry_points():
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else None
        if allow is not None and ep.name not in allow and (dist_name or "") not in allow:
            continue
        origin = Origin(ep.name, "pack", dist_name, dist.version if dist is not None else None)
        try:
            loaded.append((ep.load(), origin))
        except Exception as exc:  # error isolation: one broken pack never breaks the rest
            _record_failure(registry, origin, exc, registry.strict)
    return loaded


def build_registry(extra_plugins: Iterable[tuple[Any, Origin]] = (),
                   configure: Callable[[pluggy.PluginManager], None] | None = None) -> Registry:
    """Create the plugin manager, load built-ins and packs, and collect every registered item by
    calling each hook once through the plugin manager (``pm.hook.register_strategies(register=...)``),
    so ``tryfirst``/``trylast``, hook wrappers and call monitoring apply. ``configure(pm)`` runs
    before the hooks are called (e.g. ``pm.add_hookcall_monitoring``)."""
    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    registry = Registry(strict=_env_flag("GENKIT_STRICT_PLUGINS"))
    registry.pm = pm

    # the built-in plugin is found by name, as a pack is by its entry point: it sits above the
    # registry (docs/architecture.md)
    builtin_strategies = importlib.import_module(BUILTIN_PLUGIN)
    plugins = [(builtin_strategies, Origin("builtin", "builtin")), *_load_packs(registry), *extra_plugins]
    for _plugin, origin in plugins:  # report order: built-ins, packs, extras
        registry.plugins.setdefault(origin.plugin, _plugin_info(origin))
    # pluggy calls the last registered first: register the built-ins last so they run first
    for plugin, origin in reversed(plugins):
        pm.register(plugin, name=origin.plugin)
        _attach(pm, registry, plugin, origin)
    pm.check_pending()
    if configure is not None:
        configure(pm)
    for kind in KIND_TABLE:
        getattr(pm.hook, kind.hook)(register=registry.register_function(kind))
    for _plugin, origin in plugins:  # a plugin that registered nothing stays listed
        if origin.plugin not in registry.failed:
            registry.plugins.setdefault(origin.plugin, _plugin_info(origin))
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
    """Register a plugin object (module or class with hookimpls) at run time: its hooks are called
    through the plugin manager (``pm.subset_hook_caller``: this plugin's implementations only)."""
    reg = get_registry()
    assert reg.pm is not None
    origin = Origin(name, "runtime")
    reg.pm.register(plugin, name=name)
    reg.plugins.setdefault(name, _plugin_info(origin))
    _attach(reg.pm, reg, plugin, origin)
    others = [p for p in reg.pm.get_plugins() if p is not plugin]
    for kind in KIND_TABLE:
        reg.pm.subset_hook_caller(kind.hook, remove_plugins=others)(register=reg.register_function(kind))
