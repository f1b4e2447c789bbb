"""The one registry: things looked up by name (methods, model presets, data sources), never by
if/elif chains. ``Registry`` is a dict with a registering decorator and a lookup whose error
lists what is known."""
from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """``what`` names the kind in errors ("removal method", "model preset", "data source");
    ``builtins`` is the package whose import registers the built-in entries."""

    def __init__(self, what: str, builtins: str | None = None) -> None:
        super().__init__()
        self.what, self.builtins = what, builtins

    def add(self, name: str, item: T) -> T:
        if name in self:
            raise ValueError(f"{self.what} '{name}' registered twice")
        self[name] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")``."""
        return lambda item: self.add(name, item)

    def get_known(self, name: str) -> T:
        """The entry called ``name``; ``ValueError`` listing the known names otherwise."""
        if self.builtins:
            importlib.import_module(self.builtins)
        if name not in self:
            raise ValueError(f"{self.what} '{name}' is unknown; choose one of {sorted(self)}")
        return self[name]
