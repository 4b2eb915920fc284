"""pluggy used as pluggy: every hook is called through the plugin manager, so ``tryfirst``, hook
wrappers (old and new style) and call monitoring work; items keep the origin of the plugin whose
implementation registered them; strategy selection has no ties; any item may own config fields."""

from __future__ import annotations

import pytest

import genkit
from genkit.errors import GenkitError, PluginError
from genkit.plugins import KIND_TABLE, FieldSpec, Origin, build_registry, hookspecs


@pytest.fixture(autouse=True)
def _no_packs(monkeypatch):
    monkeypatch.setenv("GENKIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("GENKIT_STRICT_PLUGINS", raising=False)


def _decode(*args, **kwargs):
    return None


class Plain:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    @genkit.hookimpl
    def register_strategies(self, register):
        self.calls.append(self.name)
        register(f"{self.name}_strategy", _decode)


class First(Plain):
    @genkit.hookimpl(tryfirst=True)
    def register_strategies(self, register):
        self.calls.append(self.name)
        register(f"{self.name}_strategy", _decode)


def test_each_hook_is_called_once_through_the_plugin_manager_with_monitoring():
    seen = []

    def before(hook_name, hook_impls, kwargs):
        seen.append((hook_name, sorted(impl.plugin_name for impl in hook_impls), sorted(kwargs)))

    def after(outcome, hook_name, hook_impls, kwargs):
        seen.append(("done", hook_name))

    calls: list[str] = []
    reg = build_registry([(Plain(calls, "a"), Origin("a", "runtime"))],
                         configure=lambda pm: pm.add_hookcall_monitoring(before, after))
    hooks = [k.hook for k in KIND_TABLE]
    assert [s[0] for s in seen if s[0] != "done"] == hooks
    assert [s[1] for s in seen if s[0] == "done"] == hooks
    assert seen[0] == ("register_strategies", ["a", "builtin"], ["register"])
    assert reg.items["strategy"]["a_strategy"].origin == Origin("a", "runtime")
    assert reg.items["strategy"]["greedy"].origin.kind == "builtin"
    assert reg.plugins["a"]["hooks"] == ["register_strategies"]


def test_tryfirst_and_trylast_order_the_calls():
    calls: list[str] = []

    class Last(Plain):
        @genkit.hookimpl(trylast=True)
        def register_strategies(self, register):
            self.calls.append(self.name)
            register(f"{self.name}_strategy", _decode)

    plugins = [(Last(calls, "last"), Origin("last", "runtime")), (Plain(calls, "plain"), Origin("plain", "runtime")),
               (First(calls, "first"), Origin("first", "runtime"))]
    reg = build_registry(plugins)
    assert calls == ["first", "plain", "last"]
    for name in ("first", "plain", "last"):
        assert reg.items["strategy"][f"{name}_strategy"].origin.plugin == name


@pytest.mark.parametrize("style", ["wrapper", "hookwrapper"])
def test_hook_wrappers_wrap_every_implementation(style):
    calls: list[str] = []
    observed: dict[str, object] = {}

    class Wrapper:
        if style == "wrapper":
            @genkit.hookimpl(wrapper=True)
            def register_strategies(self, register):
                observed["before"] = list(calls)
                register("from_wrapper", _decode)  # a wrapper may register too, under its own origin
                result = yield
                observed["after"] = list(calls)
                return result
        else:
            @genkit.hookimpl(hookwrapper=True)
            def register_strategies(self, register):
                observed["before"] = list(calls)
                register("from_wrapper", _decode)
                outcome = yield
                outcome.get_result()
                observed["after"] = list(calls)

    reg = build_registry([(Plain(calls, "a"), Origin("a", "runtime")), (Wrapper(), Origin("w", "runtime"))])
    assert observed == {"before": [], "after": ["a"]}
    assert reg.items["strategy"]["from_wrapper"].origin.plugin == "w"
    assert reg.items["strategy"]["a_strategy"].origin.plugin == "a"


def test_a_failing_implementation_is_rolled_back_and_the_others_keep_working(caplog):
    calls: list[str] = []

    class Broken:
        @genkit.hookimpl
        def register_strategies(self, register):
            register("half_registered", _decode)
            raise RuntimeError("boom in a hook")

        @genkit.hookimpl
        def register_streamers(self, register):
            register("never_registered", _decode)

    reg = build_registry([(Broken(), Origin("broken", "runtime")), (Plain(calls, "a"), Origin("a", "runtime"))])
    assert reg.failed == {"broken": "RuntimeError: boom in a hook"}
    assert "half_registered" not in reg.items["strategy"] and "never_registered" not in reg.items["streamer"]
    assert "broken" not in reg.plugins and "a_strategy" in reg.items["strategy"]
    assert "genkit plugin 'broken' failed to load and was skipped: RuntimeError: boom in a hook" in caplog.text


def test_a_pack_that_runs_first_cannot_take_a_builtin_name():
    """Even when a pack's implementation runs before the built-ins (tryfirst), the pack fails."""

    class Thief:
        @genkit.hookimpl(tryfirst=True)
        def register_strategies(self, register):
            register("greedy", _decode)

    reg = build_registry([(Thief(), Origin("thief", "pack", "thief-pack", "1.0"))])
    assert reg.failed == {"thief": "PluginError: duplicate strategy name 'greedy': registered by built-in (builtin) "
                                   "and by thief-pack@1.0 (thief)"}
    assert reg.items["strategy"]["greedy"].origin.kind == "builtin"


def test_register_options_are_the_item_fields():
    class Typo:
        @genkit.hookimpl
        def register_strategies(self, register):
            register("typo", _decode, priorty=3)

    reg = build_registry([(Typo(), Origin("typo", "runtime"))])
    assert reg.failed["typo"] == ("PluginError: runtime typo: register() for a strategy takes the options "
                                  "applies, description, fields, priority; got priorty")


def test_equal_priorities_that_both_apply_are_an_error_naming_both():
    class Twins:
        @genkit.hookimpl
        def register_strategies(self, register):
            register("twin_a", _decode, applies=lambda c: c.top_k == 7, priority=50)
            register("twin_b", _decode, applies=lambda c: c.top_k == 7, priority=50)
            register("single", _decode, applies=lambda c: c.top_k == 9, priority=50)

    reg = build_registry([(Twins(), Origin("twins", "runtime"))])
    with pytest.raises(PluginError, match=r"strategy selection is ambiguous: 'twin_.' \(runtime twins\) and 'twin_.' "
                                          r"\(runtime twins\) both apply .* with priority 50") as err:
        reg.select_strategy(genkit.GenerationConfig(top_k=7).with_defaults())
    assert isinstance(err.value, GenkitError)
    assert reg.select_strategy(genkit.GenerationConfig(top_k=9).with_defaults()).name == "single"
    assert reg.select_strategy(genkit.GenerationConfig().with_defaults()).name == "greedy"


def test_builtin_selectors_have_no_ties():
    """Every combination of the switches the built-in selectors read picks exactly one strategy."""
    reg = build_registry()
    for beams in (1, 2, 4):
        for sample in (False, True):
            for groups in (1, 2):
                for force in (None, [[5]]):
                    for lookup in (None, 3):
                        cfg = genkit.GenerationConfig().with_defaults()
                        for k, v in dict(num_beams=beams, do_sample=sample, num_beam_groups=groups,
                                         force_words_ids=force, prompt_lookup_num_tokens=lookup).items():
                            object.__setattr__(cfg, k, v)
                        try:
                            reg.select_strategy(cfg)
                        except PluginError as exc:  # pragma: no cover - the assertion below shows it
                            pytest.fail(str(exc))
                        except GenkitError:
                            pass  # no strategy applies (e.g. groups with sampling): not a tie


def test_any_item_may_own_config_fields():
    knob = FieldSpec("knob_level", 1, lambda v: isinstance(v, int) and v > 0, "an int > 0")

    class Owner:
        @genkit.hookimpl
        def register_streamers(self, register):
            register("knobbed", _decode, fields=[knob])

    reg = build_registry([(Owner(), Origin("owner", "runtime"))])
    assert reg.fields["knob_level"] == (knob, Origin("owner", "runtime"))
    with pytest.raises(ValueError, match=r"`knob_level` must be an int > 0; got 0"):
        knob.validate(0)


def test_runtime_registration_goes_through_the_plugin_manager():
    from genkit.plugins import get_registry, register_plugin, reset_registry

    reset_registry()
    try:
        reg = get_registry()
        seen = []
        reg.pm.add_hookcall_monitoring(lambda name, impls, kw: seen.append((name, [i.plugin_name for i in impls])),
                                       lambda *a: None)
        register_plugin(Plain([], "late"), name="late")
        assert ("register_strategies", ["late"]) in seen
        assert reg.items["strategy"]["late_strategy"].origin == Origin("late", "runtime")
    finally:
        reset_registry()


def test_hookspecs_and_kinds_are_one_table():
    """Adding a hook is one hookspec plus one entry of KIND_TABLE."""
    specs = {name for name, fn in vars(hookspecs).items() if hasattr(fn, "genkit_spec")}
    assert specs == {k.hook for k in KIND_TABLE}
