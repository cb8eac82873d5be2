"""One file per method, each reading like its row in docs/methods.md.

Every module here is imported, and what it defines (its compressor, its registered factory)
is exported: a new method is a new file."""
import importlib
import pkgutil

__all__ = []
for _info in pkgutil.iter_modules(__path__):
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    for _name, _value in vars(_module).items():
        if not _name.startswith("_") and getattr(_value, "__module__", None) == _module.__name__:
            globals()[_name] = _value
            __all__.append(_name)
__all__.sort()
del _info, _module, _name, _value
