"""A pickle interpreter that builds plain data and allow-listed objects, and changes nothing else.

Python's ``pickle.Unpickler`` with a restricted ``find_class`` is not enough: once a class is
allowed, the BUILD opcode (``__setstate__``, or ``setattr`` of a "slot state") applies to
whatever is on the stack, the class object itself included, so an allowed class (a pathlib
class, a DCP dataclass, ``enum.Enum``) can be rewritten for the rest of the process. torch's own
weights-only unpickler does not read the protocol-4 pickles DCP writes (``FRAME``,
``STACK_GLOBAL``, ``MEMOIZE``) and is extended only through a process-wide allow-list.

:func:`restricted_load` interprets the opcodes itself:

- a global is resolved through ``resolve`` to a :class:`Allowed` entry: a constant (a dtype), a
  side-effect-free factory called by REDUCE (``torch.Size``, an enum lookup), or a dataclass
  that NEWOBJ may instantiate. The class object never reaches the stack, so nothing can BUILD it;
- BUILD applies only to an instance this load created with NEWOBJ, once, through ``build``;
- a pickled dict becomes a :class:`PairList` (its pairs, in order): no key is hashed until the
  caller has checked it, so crafted hash collisions cost nothing here;
- the opcodes that run code or reach outside the data (``INST``, ``OBJ``, ``PERSID``, ``EXT*``,
  ``NEWOBJ_EX``, out-of-band buffers) are refused; every other opcode DCP never writes is refused
  as not DCP metadata. Each opcode does constant work per byte it consumed, so the work is linear
  in the file's size.
"""

from __future__ import annotations

import io
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_torchrec.errors import CheckpointCorruptError, UnsafeCheckpointError


@dataclass(frozen=True)
class Allowed:
    """What a pickle global may stand for (never the class or function object itself).

    Attributes:
        name: ``module.name``, for messages.
        value: pushed as is (a constant such as a dtype) when ``call`` and ``new`` are None.
        call: what REDUCE calls with the pickled arguments (must have no side effects).
        new: the class NEWOBJ instantiates (no arguments, no ``__init__``); BUILD then fills it.
    """

    name: str
    value: Any = None
    call: Callable[..., Any] | None = None
    new: type | None = None


class PairList(list):
    """A pickled dict's ``(key, value)`` pairs in order; a dict once its keys are checked."""


_DANGEROUS = {
    b"i": "INST",
    b"o": "OBJ",
    b"P": "PERSID",
    b"Q": "BINPERSID",
    b"\x82": "EXT1",
    b"\x83": "EXT2",
    b"\x84": "EXT4",
    b"\x92": "NEWOBJ_EX",
    b"\x97": "NEXT_BUFFER",
    b"\x98": "READONLY_BUFFER",
}

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

#: Longest integer accepted (bytes of LONG1/LONG4): far beyond any size or offset.
_MAX_LONG_BYTES = 16

_MARK = object()


class _Interpreter:
    def __init__(
        self,
        data: bytes,
        file: Path,
        resolve: Callable[[str, str], Allowed | None],
        build: Callable[[Any, Any], None],
    ) -> None:
        self.f = io.BytesIO(data)
        self.file = file
        self.resolve = resolve
        self.build = build
        self.stack: list[Any] = []
        self.memo: dict[int, Any] = {}
        self.fresh: dict[int, Any] = {}  # id -> instance made by NEWOBJ, awaiting BUILD

    def corrupt(self, why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{self.file} cannot be read (truncated or damaged; not DCP metadata): {why}"
        )

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise self.corrupt("unexpected end of file")
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def line(self) -> str:
        raw = self.f.readline(256)
        if not raw.endswith(b"\n"):
            raise self.corrupt("a global's name is not terminated")
        return raw[:-1].decode("ascii", "strict")

    def pop_mark(self) -> list[Any]:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] is _MARK:
                items = self.stack[i + 1 :]
                del self.stack[i:]
                return items
        raise self.corrupt("no mark on the stack")

    def pop(self) -> Any:
        value = self.stack.pop()
        if value is _MARK:
            raise self.corrupt("a mark where a value belongs")
        return value

    def push_global(self, module: str, name: str) -> None:
        if not (_DOTTED.fullmatch(module) and _DOTTED.fullmatch(name)):
            raise self.corrupt(f"invalid global name {module!r} {name!r}")
        allowed = self.resolve(module, name)
        if allowed is None:
            raise UnsafeCheckpointError(
                f"Refusing to load {self.file}: it references the global '{module}.{name}', which "
                "is not part of torch.distributed.checkpoint metadata (loading it could run code "
                "or change this process). Nothing was executed. Only load checkpoints from "
                "sources you trust."
            )
        self.stack.append(
            allowed.value if allowed.call is None and allowed.new is None else allowed
        )

    def reduce(self) -> None:
        args = self.pop()
        func = self.pop()
        if not isinstance(func, Allowed) or func.call is None or not isinstance(args, tuple):
            raise UnsafeCheckpointError(
                f"Refusing to load {self.file}: it calls {getattr(func, 'name', type(func))}, "
                "which DCP metadata never calls. Nothing was executed."
            )
        try:
            self.stack.append(func.call(*args))
        except (TypeError, ValueError, RuntimeError, OverflowError, KeyError) as err:
            raise self.corrupt(f"{func.name}{args!r:.80}: {err}") from err

    def newobj(self) -> None:
        args = self.pop()
        cls = self.pop()
        if not isinstance(cls, Allowed) or cls.new is None or args != ():
            raise UnsafeCheckpointError(
                f"Refusing to load {self.file}: it creates {getattr(cls, 'name', type(cls))} "
                f"with arguments {args!r:.80}, which DCP metadata never does."
            )
        instance = object.__new__(cls.new)
        self.fresh[id(instance)] = instance
        self.stack.append(instance)

    def build_top(self) -> None:
        state = self.pop()
        if not self.stack or id(self.stack[-1]) not in self.fresh:
            target = type(self.stack[-1]).__name__ if self.stack else "nothing"
            raise UnsafeCheckpointError(
                f"Refusing to load {self.file}: it sets the state of a {target}, which is not an "
                "object this load created (it could change a class of this process). Nothing "
                "was changed."
            )
        instance = self.fresh.pop(id(self.stack[-1]))
        self.build(instance, state)

    def set_items(self, pairs: list[Any]) -> None:
        target = self.stack[-1] if self.stack else None
        if type(target) is not PairList or len(pairs) % 2:
            raise self.corrupt("dict items for something that is not a dict")
        target.extend(zip(pairs[::2], pairs[1::2], strict=True))

    def append_items(self, items: list[Any]) -> None:
        target = self.stack[-1] if self.stack else None
        if type(target) is not list:
            raise self.corrupt("list items for something that is not a list")
        target.extend(items)

    def step(self, op: bytes) -> bool:  # noqa: C901 - one branch per opcode
        push = self.stack.append
        if op == b"\x80":
            if self.read(1)[0] not in (2, 3, 4, 5):
                raise self.corrupt("unknown pickle protocol")
        elif op == b"\x95":
            self.read(8)
        elif op == b".":
            return True
        elif op == b"(":
            push(_MARK)
        elif op == b"0":
            self.pop()
        elif op == b"1":
            self.pop_mark()
        elif op == b"2":
            push(self.stack[-1])
        elif op in (b"q", b"r", b"\x94"):
            if self.stack[-1] is _MARK:
                raise self.corrupt("memoizing a mark")
            index = {b"q": lambda: self.read(1)[0], b"r": lambda: self.unpack("<I")}.get(
                op, lambda: len(self.memo)
            )()
            self.memo[index] = self.stack[-1]
        elif op in (b"h", b"j"):
            index = self.read(1)[0] if op == b"h" else self.unpack("<I")
            if index not in self.memo:
                raise self.corrupt(f"memo entry {index} is missing")
            push(self.memo[index])
        elif op == b"N":
            push(None)
        elif op in (b"\x88", b"\x89"):
            push(op == b"\x88")
        elif op == b"J":
            push(self.unpack("<i"))
        elif op == b"K":
            push(self.read(1)[0])
        elif op == b"M":
            push(self.unpack("<H"))
        elif op in (b"\x8a", b"\x8b"):
            n = self.read(1)[0] if op == b"\x8a" else self.unpack("<i")
            if not 0 <= n <= _MAX_LONG_BYTES:
                raise self.corrupt(f"an integer of {n} bytes")
            push(int.from_bytes(self.read(n), "little", signed=True))
        elif op == b"G":
            push(self.unpack(">d"))
        elif op in (b"X", b"\x8c", b"\x8d"):
            n = {b"X": lambda: self.unpack("<I"), b"\x8c": lambda: self.read(1)[0]}.get(
                op, lambda: self.unpack("<Q")
            )()
            push(self.read(n).decode("utf-8", "surrogatepass"))
        elif op == b")":
            push(())
        elif op == b"t":
            push(tuple(self.pop_mark()))
        elif op in (b"\x85", b"\x86", b"\x87"):
            n = op[0] - 0x84
            items = [self.pop() for _ in range(n)][::-1]
            push(tuple(items))
        elif op == b"]":
            push([])
        elif op == b"l":
            push(self.pop_mark())
        elif op == b"a":
            self.append_items([self.pop()])
        elif op == b"e":
            self.append_items(self.pop_mark())
        elif op == b"}":
            push(PairList())
        elif op == b"d":
            pairs = self.pop_mark()
            push(PairList())
            self.set_items(pairs)
        elif op == b"s":
            value, key = self.pop(), self.pop()
            self.set_items([key, value])
        elif op == b"u":
            self.set_items(self.pop_mark())
        elif op == b"c":
            self.push_global(self.line(), self.line())
        elif op == b"\x93":
            name, module = self.pop(), self.pop()
            if not (isinstance(module, str) and isinstance(name, str)):
                raise self.corrupt("a global named by something that is not a string")
            self.push_global(module, name)
        elif op == b"R":
            self.reduce()
        elif op == b"\x81":
            self.newobj()
        elif op == b"b":
            self.build_top()
        elif op in _DANGEROUS:
            raise UnsafeCheckpointError(
                f"Refusing to load {self.file}: its pickle uses {_DANGEROUS[op]}, which DCP "
                "metadata never does (it could run code or read outside the file). Nothing was "
                "executed."
            )
        else:
            raise self.corrupt(f"opcode {op!r} at byte {self.f.tell() - 1}")
        return False

    def run(self) -> Any:
        while True:
            op = self.f.read(1)
            if not op:
                raise self.corrupt("unexpected end of file")
            if self.step(op):
                if len(self.stack) != 1:
                    raise self.corrupt("the pickle does not end with one object")
                return self.pop()


def restricted_load(
    data: bytes,
    file: Path,
    resolve: Callable[[str, str], Allowed | None],
    build: Callable[[Any, Any], None],
) -> Any:
    """Unpickles ``data`` admitting only what ``resolve`` allows; see the module docstring.

    Args:
        data: the pickle.
        file: its file, for messages.
        resolve: ``(module, name) -> Allowed | None`` (None: refused as unsafe).
        build: applies a BUILD state to an instance this load created (raises ``ValueError`` or
            ``TypeError`` for a state it does not accept).

    Returns:
        The object; dicts in it are :class:`PairList` s.

    Raises:
        UnsafeCheckpointError: for a global, call or opcode that could run code or change this
            process, naming the file.
        CheckpointCorruptError: for anything else that is not a well-formed pickle of the
            allowed objects.
    """
    interpreter = _Interpreter(data, file, resolve, build)
    try:
        return interpreter.run()
    except (UnsafeCheckpointError, CheckpointCorruptError):
        raise
    except (IndexError, ValueError, TypeError, struct.error, UnicodeError, RecursionError) as err:
        raise interpreter.corrupt(f"{type(err).__name__}: {err}") from err
