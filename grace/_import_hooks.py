"""Run grace's Horovod adapter right after a Horovod framework module is imported.

``import grace`` must import no toolkit and no Horovod module (importing horovod.torch into a
TensorFlow process silently breaks Horovod's TensorFlow averaging), yet
``hvd.DistributedOptimizer(opt, compression=grace.topk(0.01))`` must work whichever of the two
was imported first. So each adapter is installed either at once, when its Horovod module is
already loaded, or by a meta-path finder the moment that module finishes loading.
"""
from __future__ import annotations

import importlib
import importlib.abc
import sys

_ADAPTERS = {  # Horovod module: (adapter module, its install function)
    "horovod.torch": ("grace.torch.horovod_hook", "install"),
    "horovod.tensorflow": ("grace.tensorflow.horovod_hook", "install"),
    "horovod.tensorflow.keras": ("grace.tensorflow.horovod_hook", "install_keras"),
}
_installed = set()


def _install(module_name: str) -> None:
    if module_name not in _installed:
        _installed.add(module_name)
        adapter, function = _ADAPTERS[module_name]
        getattr(importlib.import_module(adapter), function)(sys.modules[module_name])


class _LoaderWithHook(importlib.abc.Loader):
    def __init__(self, loader, module_name):
        self._loader = loader
        self._module_name = module_name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _install(self._module_name)

    def __getattr__(self, attr):  # get_data, get_filename, is_package, ...
        return getattr(self._loader, attr)


class _HorovodFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _ADAPTERS or fullname in _installed:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _LoaderWithHook(spec.loader, fullname)
                return spec
        return None


def install_import_hooks() -> None:
    for module_name in _ADAPTERS:
        if module_name in sys.modules:
            _install(module_name)
    if not any(isinstance(f, _HorovodFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _HorovodFinder())
