"""Loading a user's own class (a policy, a router) named on the command line, without editing
servesim: `path/to/file.py:ClassName` or `package.module:ClassName`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from sim.errors import ServesimError


def plugin_file(spec: str) -> Path | None:
    """The file of a user's plugin named `FILE.py:Class` (as given, not resolved) or `module:Class` (where
    the module is found: its origin), without running it; None for a built-in's name or a module not found."""
    source, sep, _ = spec.rpartition(":")
    if not sep or not source:
        return None
    if source.endswith(".py"):
        return Path(source)
    try:
        found = importlib.util.find_spec(source)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin else None


def load_class(spec: str, registry: dict[str, type], base: type, what: str) -> type:
    """The class `spec` names: a key of `registry`, or a user's class given as `FILE.py:Class` or
    `module:Class`, which must subclass `base`. `what` names the kind in errors ("policy")."""
    if spec in registry:
        return registry[spec]
    source, sep, class_name = spec.rpartition(":")
    if not sep or not source or not class_name:
        raise ServesimError(f"unknown {what} {spec!r}; choose one of {', '.join(registry)}, "
                            f"or give your own as path/to/file.py:ClassName or package.module:ClassName")
    if source.endswith(".py"):
        path = Path(source)
        if not path.is_file():
            raise ServesimError(f"--{what}: no such file: {source}")
        module_name = f"servesim_user_{what}_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise ServesimError(f"--{what}: {source} failed to load: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(source)
        except ImportError as e:
            raise ServesimError(f"--{what}: cannot import module {source!r}: {e}") from None
        except Exception as e:  # its code failed as it loaded (a syntax error, a raise at its top level)
            raise ServesimError(f"--{what}: module {source!r} failed to load: {type(e).__name__}: {e}") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ServesimError(f"--{what}: {source} has no class {class_name!r}")
    if not issubclass(cls, base):
        raise ServesimError(f"--{what}: {spec} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cls
