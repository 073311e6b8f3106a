"""kvd.errors: the code ↔ class table is a bijection and the wire round trip is lossless."""

import pytest

import kvd
from kvd.errors import ERROR_CLASSES, InternalError, KvdError, error_from_wire


def test_error_classes_is_a_bijection_code_to_class():
    classes = list(ERROR_CLASSES.values())
    assert len(set(classes)) == len(classes), "two codes map to one class"
    for code, cls in ERROR_CLASSES.items():
        assert cls.code == code, f"{cls.__name__}.code is {cls.code!r} but the table says {code!r}"


def test_every_kvd_error_subclass_is_in_the_table():
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    assert set(subclasses(KvdError)) == set(ERROR_CLASSES.values())


@pytest.mark.parametrize("code", sorted(ERROR_CLASSES))
def test_codes_are_uppercase_tokens_and_classes_subclass_kvd_error(code):
    assert code.isupper() and code.replace("_", "").isalpha()
    assert issubclass(ERROR_CLASSES[code], KvdError)


def test_design_codes_are_present():
    for code in ("BAD_ARGS", "NO_SPACE", "NOT_FOUND", "IN_USE", "PROTOCOL", "VERSION",
                 "TOO_LARGE", "UNKNOWN_OP", "DENIED", "INTERNAL"):
        assert code in ERROR_CLASSES


@pytest.mark.parametrize("code", sorted(ERROR_CLASSES))
def test_error_from_wire_round_trip(code):
    error = error_from_wire(code, "pool is full: release blocks")
    assert type(error) is ERROR_CLASSES[code]
    assert error.code == code
    assert str(error) == "pool is full: release blocks"


def test_unknown_wire_code_is_internal_and_names_the_code():
    error = error_from_wire("NO_SUCH_CODE", "boom")
    assert type(error) is InternalError
    assert "NO_SUCH_CODE" in str(error) and "boom" in str(error)


def test_builtin_bases_let_callers_catch_familiar_exceptions():
    assert issubclass(kvd.BadArgsError, ValueError)
    assert issubclass(kvd.NotFoundError, KeyError)
    assert issubclass(kvd.DeniedError, PermissionError)
    assert issubclass(kvd.DisconnectedError, ConnectionError)
    assert str(kvd.NotFoundError("block 3 is not held")) == "block 3 is not held"


def test_package_exports_every_error_class():
    for cls in ERROR_CLASSES.values():
        assert getattr(kvd, cls.__name__) is cls
    assert kvd.KvdError is KvdError and kvd.ERROR_CLASSES is ERROR_CLASSES
