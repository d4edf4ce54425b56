import sys
import subprocess
import textwrap

import pytest

from framework import ALLOCATORS, BACKENDS, POLICIES, PREPARERS, Registry, SchedulerPolicy, UnknownNameError
from framework.common.registry import BadOptionsError, UnavailableError, split_spec
from framework.scheduling.output import Step
from framework.scheduling.scheduler import Scheduler
from policies.chunked import ChunkedPolicy


def test_builtins_are_listed():
    assert "fcfs" in POLICIES.list()
    assert "paged" in ALLOCATORS.list()
    assert "naive" in BACKENDS.list()
    assert "v1" in PREPARERS.list()


@pytest.mark.parametrize("registry", [POLICIES, ALLOCATORS, BACKENDS, PREPARERS])
def test_unknown_name_lists_registered_ones(registry):
    with pytest.raises(UnknownNameError) as err:
        registry.get("no-such-thing")
    message = str(err.value)
    assert "no-such-thing" in message
    for name in registry.list():
        assert name in message


@pytest.mark.parametrize("name", [["naive", "triton"], {"name": "naive"}])
def test_a_name_that_is_not_a_string_lists_the_registered_ones(name):
    with pytest.raises(UnknownNameError, match="a backend name is a string, one of .*naive.*torch_paged"):
        BACKENDS.get(name)


def test_register_create_and_reject_duplicates():
    reg = Registry("widget", SchedulerPolicy, entry_point_group="framework.test-widgets")

    @reg.register("mine")
    class Mine(SchedulerPolicy):
        def schedule(self, scheduler: Scheduler, step: Step) -> None:
            pass

    assert reg.list() == ["mine"]
    assert isinstance(reg.create("mine"), Mine)
    assert Mine.name == "mine"
    with pytest.raises(ValueError, match="already registered"):
        @reg.register("mine")
        class Other(SchedulerPolicy):
            def schedule(self, scheduler, step):
                pass
    with pytest.raises(TypeError, match="not a subclass"):
        reg.register("bad")(int)


def test_a_built_in_name_is_refused_even_before_the_built_ins_are_imported():
    """A fresh interpreter: registering "fcfs" before any lookup was accepted; the first lookup
    then failed importing the shipped policies, and those after fcfs were never registered."""
    code = textwrap.dedent("""
        from framework import EXECUTORS, POLICIES, Executor, SchedulerPolicy

        class Mine(SchedulerPolicy):
            def schedule(self, scheduler, step):
                pass

        class MyExecutor(Executor):
            def kv_block_counts(self): ...
            def initialize(self, num_blocks, num_cpu_blocks): ...
            def execute(self, out): ...

        for registry, name, cls in [(POLICIES, "fcfs", Mine), (EXECUTORS, "model", MyExecutor)]:
            try:
                registry.register(name)(cls)
            except ValueError as exc:
                print(exc)
        print(POLICIES.get("fcfs").__module__, EXECUTORS.get("model").__module__, *POLICIES.list())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["a policy named 'fcfs' is already registered (policies.fcfs.FCFSPolicy)",
                   "a executor named 'model' is already registered (in framework.execution.executors.model)",
                   "policies.fcfs framework.execution.executors.model " + " ".join(sorted(POLICIES.list()))]


def test_a_plugin_declaring_a_taken_name_is_refused_not_ignored(tmp_path, monkeypatch):
    """A plugin entry point named like a registered class was silently ignored (the registered
    class served its name), and of two plugins declaring one name the last found won."""
    reg = _plugin_package(tmp_path, monkeypatch, "rival_widget_pkg",
                          "from framework import SchedulerPolicy\n\n\nclass Widget(SchedulerPolicy):\n"
                          "    def schedule(self, scheduler, step):\n        pass\n\n\n"
                          "class Gadget(Widget):\n    pass\n",
                          {"rival-widget-a": "builtin = rival_widget_pkg:Widget\ntwice = rival_widget_pkg:Widget\n"
                                             "own = rival_widget_pkg:Gadget\n",
                           "rival-widget-b": "twice = rival_widget_pkg:Gadget\n"}, "tests.rival-widgets")

    @reg.register("builtin")
    class BuiltIn(SchedulerPolicy):
        def schedule(self, scheduler, step):
            pass

    assert reg.list() == ["builtin", "own", "twice"]
    with pytest.raises(ValueError, match=r"plugin builtin = rival_widget_pkg:Widget declares the name of the widget "
                                         r"'builtin' already registered \(.*BuiltIn\); rename its entry point"):
        reg.get("builtin")
    with pytest.raises(ValueError, match="2 installed widget plugins declare the name 'twice'") as err:
        reg.get("twice")
    assert "rival_widget_pkg:Widget" in str(err.value) and "rival_widget_pkg:Gadget" in str(err.value)
    gadget = reg.get("own")
    assert gadget.__name__ == "Gadget" and reg.get("own") is gadget  # a plugin is not its own rival
    reg.register("own")(gadget)  # nor when registered again by hand
    assert reg.get("own") is gadget


def test_a_plugin_naming_something_other_than_a_class_of_the_kind_says_which_plugin(tmp_path, monkeypatch):
    """An entry point naming the module (``srpt = my_policies.srpt``, the ``:Class`` forgotten)
    failed with register's TypeError and a traceback, naming no entry point."""
    reg = _plugin_package(tmp_path, monkeypatch, "odd_widget_pkg", "class NotAWidget:\n    pass\n",
                          {"odd-widget": "module = odd_widget_pkg\nother = odd_widget_pkg:NotAWidget\n"},
                          "tests.odd-widgets")
    with pytest.raises(ValueError, match=r"widget plugin 'module' \(odd_widget_pkg\) is <module 'odd_widget_pkg'.*, "
                                         r"not a subclass of SchedulerPolicy: its entry point must name the class"):
        reg.get("module")
    with pytest.raises(ValueError, match=r"widget plugin 'other' \(odd_widget_pkg:NotAWidget\) is <class .*NotAWidget'>"):
        reg.get("other")


def test_importing_framework_does_not_import_triton_or_flash_attn():
    code = ("import sys, framework, policies, backends, models; "
            "from framework import BACKENDS; BACKENDS.list(); "
            "print('triton' in sys.modules, 'flash_attn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_create_turns_a_bad_option_into_a_value_error_naming_the_part():
    from framework.common.registry import Registry

    class Base:
        pass

    reg = Registry("widget", Base, entry_point_group="tests.widgets")

    @reg.register("knob")
    class Knob(Base):
        def __init__(self, size: int = 1) -> None:
            if size < 0:
                raise TypeError("a TypeError of the constructor's own")
            self.size = size

    assert reg.create("knob", size=3).size == 3
    with pytest.raises(ValueError, match=r"widget 'knob': .*unexpected keyword argument 'colour'"):
        reg.create("knob", colour="red")
    with pytest.raises(TypeError, match="constructor's own"):  # not mistaken for a bad option
        reg.create("knob", size=-1)


def test_a_bad_option_is_answered_with_the_options_the_part_takes():
    """A typo in an option's name said only "unexpected keyword argument 'long_prefil'": the
    researcher had to read the constructor to find the spelling."""
    with pytest.raises(BadOptionsError, match=r"policy 'chunked': .*'long_prefil'; "
                                              r"its options: preemption_mode, long_prefill_token_threshold, "
                                              r"reserve_full_prompt, long_prefill_cap_when_alone$"):
        POLICIES.create("chunked", long_prefil=64)
    # The engine's own arguments are no options of the allocator's.
    with pytest.raises(BadOptionsError, match=r"allocator 'paged': .*'colour'; its options: promote_duplicate$"):
        ALLOCATORS.create_with("paged", {"colour": "red"}, num_blocks=8, block_size=16, num_cpu_blocks=0,
                               enable_prefix_caching=True)
    with pytest.raises(BadOptionsError, match=r"missing a required argument: 'block_size'; its options: "
                                              r"block_size, num_cpu_blocks, enable_prefix_caching, promote_duplicate$"):
        ALLOCATORS.create("paged", 8)


def test_a_policy_passing_kwargs_to_its_base_is_answered_with_every_option_it_takes():
    """The usual way to add an option (``def __init__(self, alpha=1.0, **kw): super().__init__(**kw)``) passes a
    typo on to the base, whose TypeError names no part: it is answered with every option along the MRO."""
    reg = Registry("widget", SchedulerPolicy, entry_point_group="tests.no-widgets")

    @reg.register("alpha")
    class Alpha(ChunkedPolicy):
        def __init__(self, alpha: float = 1.0, **kw):
            super().__init__(**kw)
            self.alpha = alpha

    with pytest.raises(BadOptionsError, match=r"^widget 'alpha': got an unexpected keyword argument 'long_prefil'; "
                                              r"its options: alpha, preemption_mode, long_prefill_token_threshold, "
                                              r"reserve_full_prompt, long_prefill_cap_when_alone$"):
        reg.create("alpha", long_prefil=3)
    made = reg.create("alpha", alpha=2.0, long_prefill_token_threshold=8)
    assert (made.alpha, made.long_prefill_token_threshold) == (2.0, 8)

    @reg.register("tunable")
    class Tunable(ChunkedPolicy):  # keeps its **options: none of them is its base's to refuse
        def __init__(self, **options):
            super().__init__()
            self.options = options

    assert reg.create("tunable", boost=3).options == {"boost": 3}


def test_an_abstract_class_is_refused_when_registered_not_when_first_built():
    """A policy without ``schedule`` is refused when registered, not at its first run by Python's
    "Can't instantiate abstract class"."""
    reg = Registry("widget", SchedulerPolicy, entry_point_group="tests.no-widgets")

    class NoSchedule(SchedulerPolicy):
        pass

    with pytest.raises(TypeError, match=r"NoSchedule'> does not implement schedule of SchedulerPolicy; cannot "
                                        r"register it as a widget"):
        reg.register("none")(NoSchedule)


def test_engine_reports_an_unknown_policy_option_as_a_value_error():
    from framework import LLMEngine
    from framework.common.config import EngineConfig

    with pytest.raises(ValueError, match=r"policy 'fcfs': .*'bogus'"):
        LLMEngine(EngineConfig(model="tiny-llama", policy="fcfs", policy_options={"bogus": 1}))


def test_create_from_a_config_node():
    from framework.harness.run_logger import LOGGERS

    assert type(LOGGERS.create_from("none")) is type(LOGGERS.create("none"))
    assert type(LOGGERS.create_from({}, default="none")) is type(LOGGERS.create("none"))
    with pytest.raises(ValueError, match="a logger needs a 'name' \\(one of .*none"):
        LOGGERS.create_from({"project": "x"})
    with pytest.raises(BadOptionsError, match="logger 'none'"):
        LOGGERS.create_from({"name": "none", "colour": "blue"})
    # Neither a name nor a node (logger=5 reaching it): was "'int' object is not iterable".
    with pytest.raises(ValueError, match=r"logger must be a name or a mapping \{name: NAME, \*\*options\}, got 5"):
        LOGGERS.create_from(5)


def test_every_registry_in_the_package_is_exported_from_framework():
    """The README lists the registries as importable from ``framework``: one defined in a module but
    not exported there would fail a user's ``from framework import NAME``."""
    import importlib
    import pkgutil

    import framework

    found = {}
    for info in pkgutil.walk_packages(framework.__path__, "framework."):
        module = importlib.import_module(info.name)
        found.update({id(v): (name, v) for name, v in vars(module).items() if isinstance(v, Registry)})
    names = sorted(name for name, _ in found.values())
    assert {"POLICIES", "ALLOCATORS", "BACKENDS", "PREPARERS", "WORKLOADS", "LOGGERS"} <= set(names)
    for name, registry in found.values():
        assert name in framework.__all__, f"{name} is not in framework.__all__"
        assert getattr(framework, name) is registry, name


@pytest.mark.parametrize("pth", ["path", "import hook"])
def test_refresh_plugins_loads_a_package_installed_editable_in_this_interpreter(tmp_path, monkeypatch, pth):
    """docs/writing-a-policy.md: after `pip install -e ./my-policies` in a running interpreter (a
    notebook), refresh_plugins() makes the plugin usable. An editable install makes its package
    importable through a .pth file in site-packages (the source folder, or setuptools' import
    hook), which Python reads only at start-up; the entry point alone was listed but failed to load."""
    import site

    site_dir, src = tmp_path / "site-packages", tmp_path / "src"
    (src / "refresh_widget_pkg").mkdir(parents=True)
    site_dir.mkdir()
    (src / "refresh_widget_pkg" / "__init__.py").write_text(
        "from framework import SchedulerPolicy\n\n\nclass Widget(SchedulerPolicy):\n"
        "    def schedule(self, scheduler, step):\n        pass\n")
    monkeypatch.setattr(sys, "path", [str(site_dir), *sys.path])
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(site_dir)])
    monkeypatch.setattr(site, "ENABLE_USER_SITE", False)
    for module in ("refresh_widget_pkg", "_refresh_widget_finder"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    reg = Registry("widget", SchedulerPolicy, entry_point_group="tests.refresh-widgets")
    assert reg.list() == []

    # What `pip install -e` writes into site-packages: the metadata and a .pth file.
    dist = site_dir / "refresh_widget-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: refresh-widget\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[tests.refresh-widgets]\nmine = refresh_widget_pkg:Widget\n")
    if pth == "path":
        (site_dir / "__editable__.refresh_widget-0.1.pth").write_text(f"{src}\n")
    else:
        (site_dir / "_refresh_widget_finder.py").write_text(
            f"import sys\n\n\ndef install():\n    sys.path.append({str(src)!r})\n")
        (site_dir / "__editable__.refresh_widget-0.1.pth").write_text(
            "import _refresh_widget_finder; _refresh_widget_finder.install()\n")
    try:
        reg.refresh_plugins()
        assert reg.list() == ["mine"]
        assert type(reg.create("mine")).__name__ == "Widget"
        reg.refresh_plugins()  # a second refresh runs nothing twice
        assert sys.path.count(str(src)) == 1
    finally:
        sys.modules.pop("refresh_widget_pkg", None)
        sys.modules.pop("_refresh_widget_finder", None)


def test_a_plugin_whose_module_is_missing_is_an_unavailable_part_not_a_traceback(tmp_path, monkeypatch):
    """An entry point naming a module not installed here (a package uninstalled, a typo) is an unavailable part,
    which the command line reports in one line; a defect inside the plugin keeps its traceback."""
    reg = _plugin_package(tmp_path, monkeypatch, "faulty_widget_pkg", "raise ZeroDivisionError('in the plugin')\n",
                          {"gone-widget": "gone = no_such_widget_pkg:Widget\nfaulty = faulty_widget_pkg:Widget\n"},
                          "tests.gone-widgets")
    with pytest.raises(UnavailableError, match=r"widget plugin 'gone' \(no_such_widget_pkg:Widget\) cannot be "
                                               r"imported: No module named 'no_such_widget_pkg'; install its package"):
        reg.get("gone")
    with pytest.raises(ImportError, match=r"widget plugin 'faulty' .* failed to load: in the plugin") as err:
        reg.get("faulty")
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_a_plugin_naming_a_missing_or_abstract_class_is_one_line_naming_it(tmp_path, monkeypatch):
    """A typo in the class name (the module fine) and a class missing a method of the interface are one-line
    errors naming the plugin, before any run."""
    reg = _plugin_package(tmp_path, monkeypatch, "half_widget_pkg",
                          "from framework import SchedulerPolicy\n\n\nclass Half(SchedulerPolicy):\n    pass\n",
                          {"half-widget": "typo = half_widget_pkg:Hlaf\nhalf = half_widget_pkg:Half\n"},
                          "tests.half-widgets")
    with pytest.raises(UnavailableError, match=r"^widget plugin 'typo' \(half_widget_pkg:Hlaf\): half_widget_pkg "
                                               r"has no Hlaf$"):
        reg.get("typo")
    with pytest.raises(ValueError, match=r"^widget plugin 'half' \(half_widget_pkg:Half\) does not implement "
                                         r"schedule of SchedulerPolicy$"):
        reg.get("half")


def _plugin_package(tmp_path, monkeypatch, package: str, source: str, dists: dict[str, str], group: str) -> Registry:
    """Put ``package`` (its ``__init__`` is ``source``) on the path, with a distribution per ``dists`` item
    (name: its entry points' lines in ``group``), as installed plugins are; returns a widget registry of ``group``."""
    pkg = tmp_path / package
    pkg.mkdir()
    (pkg / "__init__.py").write_text(source)
    for dist, lines in dists.items():
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, package, raising=False)
    return Registry("widget", SchedulerPolicy, entry_point_group=group)


def test_register_without_a_name_takes_the_class_name_attribute():
    reg = Registry("widget", SchedulerPolicy, entry_point_group="tests.no-widgets")

    @reg.register()
    class Named(SchedulerPolicy):
        name = "named"

        def schedule(self, scheduler, step):
            pass

    assert reg.list() == ["named"] and reg.get("named") is Named
    with pytest.raises(ValueError, match="give it a name"):
        reg.register()(type("Nameless", (Named,), {"name": None}))


def test_a_class_registered_under_a_second_name_keeps_its_own():
    reg = Registry("widget", SchedulerPolicy, entry_point_group="tests.no-widgets")

    @reg.register("first")
    class Mine(SchedulerPolicy):
        def schedule(self, scheduler, step):
            pass

    reg.register("alias")(Mine)
    assert reg.get("alias") is reg.get("first") is Mine and Mine.name == "first"


def test_registering_a_redefined_class_again_replaces_it():
    """As a notebook cell run twice does: the same module and qualified name are the same class."""
    reg = Registry("widget", SchedulerPolicy, entry_point_group="tests.no-widgets")
    defined = []
    for _ in range(2):
        @reg.register("cell")
        class Cell(SchedulerPolicy):
            def schedule(self, scheduler, step):
                pass
        defined.append(Cell)
    assert defined[0] is not defined[1] and reg.get("cell") is defined[1]


def test_a_lazily_registered_name_is_listed_before_its_module_is_imported():
    reg = Registry("widget", SchedulerPolicy, entry_point_group="tests.no-widgets")
    reg.register_lazy("later", "no_such_module_imported_by_listing")
    assert reg.list() == ["later"] and "later" in reg
    assert "no_such_module_imported_by_listing" not in sys.modules


def test_a_lazy_module_that_does_not_register_its_name_is_an_import_error_naming_both():
    reg = Registry("widget", SchedulerPolicy, entry_point_group="tests.no-widgets")
    reg.register_lazy("later", "json")
    with pytest.raises(ImportError, match=r"^importing json did not register the widget 'later'$"):
        reg.get("later")


def test_a_constructors_own_unexpected_keyword_error_passes_through():
    reg = Registry("widget", SchedulerPolicy, entry_point_group="tests.no-widgets")

    def helper(size):
        return size

    @reg.register("knob")
    class Knob(SchedulerPolicy):
        def __init__(self, size: int = 1) -> None:
            helper(colour=size)

        def schedule(self, scheduler, step):
            pass

    with pytest.raises(TypeError, match=r"helper\(\) got an unexpected keyword argument 'colour'") as err:
        reg.create("knob", size=2)
    assert not isinstance(err.value, BadOptionsError)


def test_an_option_redeclared_by_a_subclass_is_listed_once():
    reg = Registry("widget", SchedulerPolicy, entry_point_group="tests.no-widgets")

    @reg.register("again")
    class Again(ChunkedPolicy):
        def __init__(self, preemption_mode: str = "recompute", **kw):
            super().__init__(preemption_mode=preemption_mode, **kw)

    with pytest.raises(BadOptionsError) as err:
        reg.create("again", bogus=1)
    listed = str(err.value).split("its options: ")[1].split(", ")
    assert "preemption_mode" in listed and len(listed) == len(set(listed))


def test_a_node_naming_a_class_by_target_is_refused():
    for node in ({"_target_": "my_pkg.Policy"}, {"name": None, "_target_": "my_pkg.Policy"}):
        with pytest.raises(ValueError, match=r"^policy: _target_='my_pkg.Policy' does not pick a policy here"):
            split_spec(node, "fcfs", "policy")
    assert split_spec({"name": "fcfs", "_target_": "x"}, None, "policy") == ("fcfs", {"_target_": "x"})


def test_one_plugin_found_twice_on_the_path_is_no_rival(tmp_path, monkeypatch):
    reg = _plugin_package(tmp_path, monkeypatch, "twin_widget_pkg",
                          "from framework import SchedulerPolicy\n\n\nclass Widget(SchedulerPolicy):\n"
                          "    def schedule(self, scheduler, step):\n        pass\n",
                          {"twin-widget": "twin = twin_widget_pkg:Widget\n",
                           "twin-widget-copy": "twin = twin_widget_pkg:Widget\n"},
                          "tests.twin-widgets")
    assert reg.list() == ["twin"] and "twin" in reg
    assert reg.get("twin").__name__ == "Widget"


def test_a_plugin_whose_import_fails_on_a_missing_name_is_unavailable(tmp_path, monkeypatch):
    reg = _plugin_package(tmp_path, monkeypatch, "stale_widget_pkg", "from json import no_such_name\n",
                          {"stale-widget": "stale = stale_widget_pkg:Widget\n"}, "tests.stale-widgets")
    with pytest.raises(UnavailableError, match=r"widget plugin 'stale' \(stale_widget_pkg:Widget\) cannot be imported: "
                                               r".*no_such_name"):
        reg.get("stale")


def test_a_plugin_that_fails_to_load_cannot_take_a_registered_name(tmp_path, monkeypatch):
    reg = _plugin_package(tmp_path, monkeypatch, "broken_widget_pkg", "raise RuntimeError('broken')\n",
                          {"broken-widget": "taken = broken_widget_pkg:Widget\n"}, "tests.broken-widgets")

    @reg.register("taken")
    class Taken(SchedulerPolicy):
        def schedule(self, scheduler, step):
            pass

    with pytest.raises(ValueError, match=r"plugin taken = broken_widget_pkg:Widget declares the name"):
        reg.get("taken")
