"""One base for everything kvnotes refuses; the built-in bases users expect are kept."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import kvnotes
from kvnotes.errors import ConfigError, KvnotesError


def library_exceptions() -> list[type]:
    out = []
    for info in pkgutil.walk_packages(kvnotes.__path__, "kvnotes."):
        if info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        out += [obj for _, obj in inspect.getmembers(mod, inspect.isclass)
                if issubclass(obj, BaseException) and not issubclass(obj, Warning) and obj.__module__ == mod.__name__
                and not obj.__name__.startswith("_")]  # warnings warn, private ones steer control flow
    return out


def test_every_kvnotes_exception_is_a_kvnotes_error():
    found = library_exceptions()
    assert len(found) >= 14
    assert [e.__name__ for e in found if not issubclass(e, KvnotesError)] == []


@pytest.mark.parametrize(("name", "builtin"), [("ConfigError", ValueError), ("EditError", ValueError),
                                               ("PairError", ValueError), ("UnknownModelError", KeyError)])
def test_a_wrong_argument_is_still_the_builtin_users_catch(name, builtin):
    cls = {e.__name__: e for e in library_exceptions()}[name]
    assert issubclass(cls, builtin) and issubclass(cls, KvnotesError)


def test_one_except_catches_what_kvnotes_refused():
    with pytest.raises(KvnotesError):
        raise ConfigError("x")
    assert kvnotes.KvnotesError is KvnotesError
