"""One registry mechanism for every pluggable part (policies, allocators, backends, preparers, ...).

Register with a decorator, list the names, create by name::

    from framework import POLICIES

    @POLICIES.register("my_policy")
    class MyPolicy(FCFSPolicy): ...

    POLICIES.list()                 # ['chunked', 'fcfs', 'my_policy', ...]
    POLICIES.create("my_policy", **options)

Implementations that ship with the framework are found by importing the registry's ``builtin``
package on first use (so ``import framework`` stays light and never imports triton or
flash-attn). Out-of-tree implementations are found through the entry-point group named by the
registry, e.g. in a plugin's ``pyproject.toml``::

    [project.entry-points."framework.policies"]
    my_policy = "my_pkg.policy:MyPolicy"
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import site
import sys
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A name that no implementation is registered under; the message lists the registered ones."""


class UnavailableError(RuntimeError):
    """A registered implementation that cannot run on this machine (no GPU, a package missing,
    settings its kernels do not support); the message names everything missing."""


class BadOptionsError(ValueError, TypeError):
    """Options an implementation's constructor does not take (unknown or missing). A ValueError,
    as every configuration error, and a TypeError, as Python reports a bad call."""


def split_spec(spec: str | Mapping[str, Any] | None, default: str | None = None,
               node: str = "part") -> tuple[str | None, dict[str, Any]]:
    """A config node's part name and options: the node is a name or ``{name: ..., **options}``;
    ``default`` when it names none. ValueError naming ``node`` for a node that is neither
    (``cost_model=5``) or names a class by Hydra's ``_target_`` (parts are picked by registered name)."""
    if spec is not None and not isinstance(spec, (str, Mapping)):  # dict(5): "'int' object is not iterable"
        raise ValueError(f"{node} must be a name or a mapping {{name: NAME, **options}}, got {spec!r}")
    options = {"name": spec} if isinstance(spec, str) else dict(spec or {})
    if not options.get("name") and "_target_" in options:
        # Taken for an option, it would run the default part (or fail on an unexpected keyword
        # argument), never the class the node names.
        raise ValueError(f"{node}: _target_={options['_target_']!r} does not pick a {node} here (Hydra's "
                         f"instantiate is not used): give the name the class is registered under, name: NAME "
                         f"(a class is registered with its registry's register(NAME), or an entry point)")
    return options.pop("name", None) or default, options


class Registry(Generic[T]):
    def __init__(self, kind: str, base: type[T], entry_point_group: str, builtin: str | None = None,
                 plural: str | None = None) -> None:
        self.kind = kind
        self.plural = plural or f"{kind}s"
        self.base = base
        self.entry_point_group = entry_point_group
        self.builtin = builtin
        self._classes: dict[str, type[T]] = {}
        self._lazy: dict[str, str] = {}
        self._entry_points: dict[str, Any] | None = None
        #: Names that installed plugins declare with different targets (see ``get``).
        self._rival_entry_points: dict[str, list[Any]] = {}
        #: Names whose registered class is the one their plugin entry point names.
        self._plugin_names: set[str] = set()
        self._builtins_loaded = False

    # -- registration ----------------------------------------------------------------------------
    def register(self, name: str | None = None) -> Callable[[type[T]], type[T]]:
        """Class decorator: register ``cls`` under ``name`` (default: ``cls.name``)."""

        def decorator(cls: type[T]) -> type[T]:
            key = name or getattr(cls, "name", None)
            if not key:
                raise ValueError(f"cannot register {cls.__qualname__} as a {self.kind}: give it a name")
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"{cls!r} is not a subclass of {self.base.__name__}; cannot register it as a {self.kind}")
            if inspect.isabstract(cls):  # refused here, not by Python at the first run's construction
                raise TypeError(f"{cls!r} {self._unimplemented(cls)}; cannot register it as a {self.kind}")
            # The built-ins first, so that a name they take is refused here: taken before their import,
            # it would make that import fail and leave the built-ins after it unregistered.
            self._load_builtins()
            known = self._classes.get(key)
            if known is not None and known is not cls and _qualified(known) != _qualified(cls):
                raise ValueError(f"a {self.kind} named {key!r} is already registered ({_qualified(known)})")
            lazy = self._lazy.get(key)
            if known is None and lazy is not None and cls.__module__ != lazy:
                raise ValueError(f"a {self.kind} named {key!r} is already registered (in {lazy})")
            self._classes[key] = cls
            if getattr(cls, "name", None) != key and "name" not in cls.__dict__:
                cls.name = key  # type: ignore[attr-defined]
            return cls

        return decorator

    def register_lazy(self, name: str, module: str) -> None:
        """Name an implementation that ``module`` registers when imported, and import it only
        when ``name`` is first asked for (for built-ins with heavy imports, e.g. torch)."""
        self._lazy[name] = module

    # -- lookup ----------------------------------------------------------------------------------
    def list(self) -> list[str]:
        """Every registered name: built in, registered at run time, and installed plugins."""
        self._load_builtins()
        return sorted(set(self._classes) | set(self._lazy) | set(self._plugin_entry_points()))

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``. ValueError for a name that two installed plugins declare, or a
        plugin besides a built-in or a run-time registration, as ``register`` refuses a taken name:
        silently taking one would leave the other's author measuring the wrong class."""
        self._load_builtins()
        if not isinstance(name, str):  # a list from a config (backend.name=[naive,triton]) is no name
            raise UnknownNameError(f"a {self.kind} name is a string, one of {', '.join(self.list()) or '(none)'}; "
                                   f"got {name!r}")
        ep = self._plugin_entry_points().get(name)
        rivals = self._rival_entry_points.get(name)
        if rivals:
            raise ValueError(f"{len(rivals)} installed {self.kind} plugins declare the name {name!r}: "
                             f"{', '.join(e.value for e in rivals)}; uninstall one or rename its entry point")
        if name in self._classes or name in self._lazy:
            if name in self._lazy and name not in self._classes:
                importlib.import_module(self._lazy[name])
                if name not in self._classes:
                    raise ImportError(f"importing {self._lazy[name]} did not register the {self.kind} {name!r}")
            cls = self._classes[name]
            if ep is not None and name not in self._plugin_names:
                self._check_plugin_is(name, ep, cls)
            return cls
        if ep is not None:
            cls = self._load_plugin(name, ep)
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                # A ValueError naming the entry point, where register's TypeError would name none.
                raise ValueError(f"{self.kind} plugin {name!r} ({ep.value}) is {cls!r}, not a subclass of "
                                 f"{self.base.__name__}: its entry point must name the class (module:Class)")
            if inspect.isabstract(cls):  # a ValueError naming the entry point, as above
                raise ValueError(f"{self.kind} plugin {name!r} ({ep.value}) {self._unimplemented(cls)}")
            if name not in self._classes:
                self.register(name)(cls)
            self._plugin_names.add(name)
            return self._classes[name]
        raise UnknownNameError(
            f"unknown {self.kind} {name!r}; registered {self.plural}: {', '.join(self.list()) or '(none)'}"
        )

    def _unimplemented(self, cls: type) -> str:
        return f"does not implement {', '.join(sorted(cls.__abstractmethods__))} of {self.base.__name__}"

    def _load_plugin(self, name: str, ep: Any) -> Any:
        """What entry point ``ep`` names: UnavailableError (one line) where its module cannot be imported here or
        lacks the name; ImportError with the traceback for an exception in the plugin's own code."""
        try:
            found = importlib.import_module(ep.module)
        except ImportError as exc:  # a module missing or not installed here: a one-line error, as any part's
            raise UnavailableError(f"{self.kind} plugin {name!r} ({ep.value}) cannot be imported: {exc}; "
                                   f"install its package in this environment") from exc
        except Exception as exc:  # a defect in the plugin's own code: its author needs the traceback
            raise ImportError(f"{self.kind} plugin {name!r} ({ep.value}) failed to load: {exc}") from exc
        for part in ep.attr.split(".") if ep.attr else ():
            if not hasattr(found, part):  # a typo in the entry point's class name
                raise UnavailableError(f"{self.kind} plugin {name!r} ({ep.value}): {ep.module} has no {ep.attr}")
            found = getattr(found, part)
        return found

    def create(self, name: str, *args: Any, **kwargs: Any) -> T:
        """An instance of ``name``. Arguments its constructor does not take (an unknown or missing option)
        raise ``BadOptionsError`` naming the part, the problem and the options it takes; a ``TypeError``
        raised inside the constructor passes through."""
        return self.create_with(name, kwargs, *args)

    def create_with(self, name: str, options: Mapping[str, Any], *args: Any, **given: Any) -> T:
        """An instance of ``name`` from the caller's own arguments (``args``, ``given``: an allocator's
        ``num_blocks``, say) and a user's ``options`` (``EngineConfig.*_options``). An option that is a
        caller's argument, unknown or missing raises ``BadOptionsError`` naming the part and its options."""
        cls, kwargs, fixed = self._bind(name, options, args, given)
        try:
            return cls(*args, **kwargs)
        except TypeError as exc:
            # A **kwargs constructor passing an option on to its base's, which refuses it (the usual way to add
            # an option to a subclass): named as a bad option with those of the classes along its MRO.
            refused = _UNEXPECTED.search(str(exc))
            if not (refused and refused.group(1) in options and refused.group(1) not in fixed):
                raise
            known = [key for key in _keywords(cls) if key not in fixed]
            raise BadOptionsError(f"{self.kind} {name!r}: got an unexpected keyword argument {refused.group(1)!r}; "
                                  f"its options: {', '.join(known)}") from None

    def check_options(self, name: str, options: Mapping[str, Any], *args: Any, **given: Any) -> None:
        """``create_with``'s checks of the options' names, building nothing (for a part built once a size is
        known: a typo is reported before the model loads). What the constructor checks of their values is not."""
        self._bind(name, options, args, given)

    def _bind(self, name: str, options: Mapping[str, Any], args: tuple[Any, ...], given: Mapping[str, Any]
              ) -> tuple[type[T], dict[str, Any], set[str]]:
        """(The class, its keyword arguments, the caller's own argument names); BadOptionsError as ``create_with``."""
        cls = self.get(name)
        # An option named like one of the caller's arguments would fail as Python's "got multiple
        # values" TypeError, which does not say it is an option.
        signature = inspect.signature(cls)
        positional = [p.name for p in signature.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:len(args)]
        fixed = {*positional, *given}
        # What the user may set, so that a typo (long_prefil) is answered with the right spelling.
        # Along the MRO while each constructor passes **kwargs on (a subclass adding an option to its base's).
        valid = [key for key in _keywords(cls) if key not in fixed]
        its_options = f"its options: {', '.join(valid)}" if valid else "it takes no options"
        taken = sorted(set(options) & fixed)
        if taken:
            raise BadOptionsError(f"{self.kind} {name!r}: {', '.join(map(str, taken))} "
                                  f"{'is' if len(taken) == 1 else 'are'} given by the framework from its own "
                                  f"settings, not {'an option' if len(taken) == 1 else 'options'} of the {self.kind}; "
                                  f"{its_options}")
        kwargs = {**given, **options}
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise BadOptionsError(f"{self.kind} {name!r}: {exc}; {its_options}") from None
        return cls, kwargs, fixed

    def create_from(self, spec: str | Mapping[str, Any] | None, *args: Any, default: str | None = None,
                    **given: Any) -> T:
        """An instance from a config node: a name, or ``{name: ..., **options}`` (``default``
        when it names none; a ValueError listing the registered names when there is neither).
        ``args`` and ``given`` are the caller's own arguments, as for ``create_with``."""
        name, options = split_spec(spec, default, self.kind)
        if name is None:
            raise ValueError(f"a {self.kind} needs a 'name' (one of {', '.join(self.list())})")
        return self.create_with(name, options, *args, **given)

    def __contains__(self, name: str) -> bool:
        return name in self.list()

    # -- internals -------------------------------------------------------------------------------
    def _load_builtins(self) -> None:
        if not self._builtins_loaded and self.builtin:
            self._builtins_loaded = True
            importlib.import_module(self.builtin)

    def _plugin_entry_points(self) -> dict[str, Any]:
        if self._entry_points is None:
            found: dict[str, Any] = {}
            self._rival_entry_points = {}
            for ep in entry_points(group=self.entry_point_group):
                if ep.name in found and found[ep.name].value != ep.value:
                    self._rival_entry_points.setdefault(ep.name, [found[ep.name]]).append(ep)
                found[ep.name] = ep
            self._entry_points = found
        return self._entry_points

    def _check_plugin_is(self, name: str, ep: Any, cls: type[T]) -> None:
        """Refuse plugin ``ep`` unless it is ``cls``, the class already registered as ``name``
        (a plugin that registers itself when imported)."""
        try:
            same = ep.load() is cls
        except Exception:
            same = False
        if not same:
            raise ValueError(f"the {self.kind} plugin {name} = {ep.value} declares the name of the {self.kind} "
                             f"{name!r} already registered ({_qualified(cls)}); rename its entry point")
        self._plugin_names.add(name)

    def refresh_plugins(self) -> None:
        """Forget the cached entry points and make packages installed since the interpreter started
        importable (after ``pip install`` in a notebook; see ``read_new_path_files``)."""
        read_new_path_files()
        self._entry_points = None


def read_new_path_files() -> None:
    """Apply the site directories' ``.pth`` lines that Python, reading them only at start-up, has not: add
    folders missing from ``sys.path``, run ``import`` lines whose modules are not imported. Makes a package
    installed editable (``pip install -e``) in a running interpreter importable, not just listed."""
    importlib.invalidate_caches()
    site_dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        site_dirs.append(site.getusersitepackages())
    for site_dir in site_dirs:
        if site_dir not in sys.path:
            continue  # Python did not read this one at start-up either (python -S, a foreign venv)
        try:
            names = sorted(n for n in os.listdir(site_dir) if n.endswith(".pth") and not n.startswith("."))
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(site_dir, name), encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except (OSError, UnicodeDecodeError):
                continue
            for line in lines:
                line = line.rstrip()
                if not line or line.startswith("#"):
                    continue
                if line.startswith(("import ", "import\t")):
                    modules = line[len("import"):].split(";")[0].split(",")
                    if all(m.split(" as ")[0].strip() in sys.modules for m in modules):
                        continue  # run at start-up (or imported since): running it again could do harm
                    try:
                        exec(line, {})
                    except Exception:  # as at start-up, a broken line does not stop the others
                        continue
                else:
                    path = os.path.abspath(os.path.join(site_dir, line))
                    if os.path.exists(path) and path not in sys.path:
                        sys.path.append(path)


#: Python's TypeError for a keyword argument a function does not take.
_UNEXPECTED = re.compile(r"got an unexpected keyword argument '(\w+)'")


def _keywords(cls: type) -> list[str]:
    """The keyword arguments of ``cls.__init__`` and, while each passes ``**kwargs`` on, of its bases' in MRO order."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):  # a builtin's __init__: nothing to list
            break
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and p.name != "self" and p.name not in names]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
