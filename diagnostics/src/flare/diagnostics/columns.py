"""The columnar table detectors read: numpy arrays per column, with Arrow's meaning.

Backends hand detectors a `Table`: the store backend fills it straight from DuckDB's
numpy result, so a diagnosis of the store loads neither pyarrow (~25-35 MB of a
process, more than a whole Kineto trace's data) nor pandas. Backends that build Arrow
tables (Jaeger, Tempo, the follow window) convert with `Table.from_arrow`.

The API is the small subset of `pyarrow.Table` the detectors use, with the same
results: `num_rows`, `column_names`, `column(name)` / `table[name]`, `filter`,
`slice`, `select`, `append_column`, `to_pylist`; a column's `to_numpy()` gives what
pyarrow's `to_numpy(zero_copy_only=False)` gives (integers with nulls as float64 with
NaN, text and lists as object arrays with None) and `to_pylist()` Python values with
None for null. Each column keeps its Arrow type name (`"int64"`, `"double"`,
`"list<item: int64>"`, ...), so `to_arrow()` rebuilds the typed Arrow table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

_NUMPY_TYPES = {
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
    "float": np.float32, "double": np.float64, "bool": np.bool_,
}
_TYPE_OF_DTYPE = {np.dtype(v): k for k, v in _NUMPY_TYPES.items()}


def is_list_type(type_name: str) -> bool:
    return type_name.startswith(("list<", "large_list<"))


def list_value_type(type_name: str) -> str:
    """`"list<item: int64>"` -> `"int64"`."""
    inner = type_name[type_name.index("<") + 1:-1]
    return inner.split(":", 1)[1].strip() if ":" in inner else inner.strip()


class Scalar:
    __slots__ = ("_value",)

    def __init__(self, value: Any) -> None:
        self._value = value

    def as_py(self) -> Any:
        return self._value

    def __repr__(self) -> str:
        return f"Scalar({self._value!r})"


class Column:
    """One column: `data` (numpy), `mask` (True where null, or None: no nulls), type name.

    For text and list columns `data` is an object array holding None at the nulls
    (lists as Python lists); for numbers the values under the mask are meaningless.
    """

    __slots__ = ("data", "mask", "type")

    def __init__(self, data: np.ndarray, mask: np.ndarray | None, type_name: str) -> None:
        if mask is not None and not mask.any():
            mask = None
        self.data, self.mask, self.type = data, mask, type_name

    # -- construction

    @classmethod
    def from_values(cls, values: Sequence[Any] | np.ndarray, type_name: str | None = None) -> Column:
        """From Python values (None = null) or a (masked) numpy array."""
        if isinstance(values, np.ma.MaskedArray):
            mask = np.ma.getmaskarray(values)
            data = np.ma.getdata(values)
            if data.dtype == object:
                data = data.copy()
                data[mask] = None
            return cls._typed(data, mask, type_name)
        if isinstance(values, np.ndarray) and values.dtype != object:
            return cls._typed(values, None, type_name)
        items = list(values)
        mask = np.fromiter((v is None for v in items), dtype=bool, count=len(items))
        if type_name is None or type_name == "string" or is_list_type(type_name) \
                or type_name not in _NUMPY_TYPES:
            data = np.empty(len(items), dtype=object)
            data[:] = items
            return cls._typed(data, mask, type_name or "string")
        filler = False if type_name == "bool" else 0
        data = np.array([filler if v is None else v for v in items], dtype=_NUMPY_TYPES[type_name])
        return cls(data, mask, type_name)

    @classmethod
    def _typed(cls, data: np.ndarray, mask: np.ndarray | None, type_name: str | None) -> Column:
        if data.dtype == object:
            # DuckDB's LIST values come as arrays, and a column is all of one type: its
            # first value says (a scan of every value of 885 k collective rows' text
            # columns took 1.3 s at 6,144 ranks)
            first = next((v for v in data if v is not None), None)
            if isinstance(first, np.ndarray):
                out = np.empty(len(data), dtype=object)
                out[:] = [v.tolist() if isinstance(v, np.ndarray) else v for v in data]
                data = out
            return cls(data, mask, type_name or "string").cast(type_name or "string")
        column = cls(data, mask, _TYPE_OF_DTYPE.get(data.dtype, "double"))
        return column.cast(type_name) if type_name else column

    # -- pyarrow's reading API

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Scalar:
        index = int(index)
        if self.mask is not None and self.mask[index]:
            return Scalar(None)
        value = self.data[index]
        return Scalar(value.item() if isinstance(value, np.generic) else value)

    @property
    def null_count(self) -> int:
        return 0 if self.mask is None else int(self.mask.sum())

    def is_valid(self) -> np.ndarray:
        return np.ones(len(self.data), dtype=bool) if self.mask is None else ~self.mask

    def to_numpy(self, zero_copy_only: bool = False) -> np.ndarray:
        kind = self.data.dtype.kind
        if self.mask is None:
            if kind == "O" and is_list_type(self.type):
                out = np.empty(len(self.data), dtype=object)
                dtype = _NUMPY_TYPES.get(list_value_type(self.type))
                out[:] = [None if v is None else np.array(v, dtype=dtype) for v in self.data]
                return out
            return self.data
        if kind in "iuf":
            out = self.data.astype(np.float64 if kind in "iu" else self.data.dtype)
            out[self.mask] = np.nan
            return out
        if kind == "b":
            out = self.data.astype(object)
            out[self.mask] = None
            return out
        return self._object_numpy()

    def _object_numpy(self) -> np.ndarray:
        if is_list_type(self.type):
            out = np.empty(len(self.data), dtype=object)
            dtype = _NUMPY_TYPES.get(list_value_type(self.type))
            out[:] = [None if v is None else np.array(v, dtype=dtype) for v in self.data]
            return out
        return self.data

    def to_pylist(self) -> list[Any]:
        values = self.data.tolist()
        if self.mask is not None and self.data.dtype != object:
            for index in np.flatnonzero(self.mask).tolist():
                values[index] = None
        return values

    def take(self, indices: np.ndarray) -> Column:
        return Column(self.data[indices], None if self.mask is None else self.mask[indices],
                      self.type)

    def cast(self, type_name: str) -> Column:
        """The column as `type_name` (nulls stay null), as Arrow's safe numeric casts."""
        if type_name == self.type and not (self.data.dtype == object and type_name in _NUMPY_TYPES):
            return self
        if type_name in _NUMPY_TYPES:
            dtype = _NUMPY_TYPES[type_name]
            if self.data.dtype == object:
                return Column.from_values(self.data.tolist(), type_name)
            data = self.data
            if self.mask is not None and data.dtype.kind == "f" and np.dtype(dtype).kind in "iub":
                data = np.where(self.mask, 0, data)
            return Column(data.astype(dtype), self.mask, type_name)
        return Column(self.data, self.mask, type_name)

    def to_arrow(self):
        import pyarrow as pa

        return pa.array(self.to_pylist(), type=_arrow_type(self.type))


class Table:
    """Named columns of equal length (see the module docstring)."""

    __slots__ = ("_columns", "_rows")

    def __init__(self, columns: Mapping[str, Column], num_rows: int | None = None) -> None:
        self._columns = dict(columns)
        if num_rows is None:
            num_rows = len(next(iter(self._columns.values()))) if self._columns else 0
        self._rows = num_rows

    @classmethod
    def from_numpy(cls, arrays: Mapping[str, np.ndarray], types: Mapping[str, str] | None = None) -> Table:
        """From DuckDB's `fetchnumpy()` result; `types` overrides a column's type name."""
        types = types or {}
        return cls({name: Column.from_values(values, types.get(name))
                    for name, values in arrays.items()})

    @classmethod
    def from_pydict(cls, columns: Mapping[str, Sequence[Any]],
                    types: Mapping[str, str] | None = None) -> Table:
        types = types or {}
        return cls({name: Column.from_values(values, types.get(name))
                    for name, values in columns.items()})

    @classmethod
    def from_arrow(cls, table) -> Table:
        """From a `pyarrow.Table` (types kept by name)."""
        out: dict[str, Column] = {}
        # One chunk per column first: chDB hands a block per chunk (256 for a bucketed
        # step summary of 1,024 ranks), and converting chunk by chunk took 1.85 s
        # against 0.49 s after a 0.03 s combine.
        table = table.combine_chunks()
        for name, chunked in zip(table.column_names, table.columns, strict=True):
            type_name = str(chunked.type)
            if type_name in _NUMPY_TYPES and chunked.null_count == 0:
                out[name] = Column(np.asarray(chunked.to_numpy()), None, type_name)
            elif type_name in _NUMPY_TYPES:
                # Numbers with nulls: the values with a mask, not a Python object per
                # value (a bucketed step summary of 1,024 ranks: 1.2 M rows x 14 columns).
                import pyarrow.compute as pc

                mask = np.asarray(chunked.is_null().to_numpy(zero_copy_only=False), dtype=bool)
                filled = pc.fill_null(chunked, False if type_name == "bool" else 0)
                out[name] = Column(np.asarray(filled.to_numpy(), dtype=_NUMPY_TYPES[type_name]),
                                   mask, type_name)
            else:
                out[name] = Column.from_values(chunked.to_pylist(), type_name)
        return cls(out, table.num_rows)

    def to_arrow(self):
        import pyarrow as pa

        return pa.table({name: column.to_arrow() for name, column in self._columns.items()})

    @property
    def num_rows(self) -> int:
        return self._rows

    def __len__(self) -> int:
        return self._rows

    @property
    def column_names(self) -> list[str]:
        return list(self._columns)

    @property
    def types(self) -> dict[str, str]:
        return {name: column.type for name, column in self._columns.items()}

    @property
    def nbytes(self) -> int:
        return sum(c.data.nbytes for c in self._columns.values())

    def column(self, key: str | int) -> Column:
        if isinstance(key, int):
            return list(self._columns.values())[key]
        try:
            return self._columns[key]
        except KeyError:
            raise KeyError(f"no column {key!r}") from None

    def __getitem__(self, key: str | int) -> Column:
        return self.column(key)

    def __contains__(self, name: str) -> bool:
        return name in self._columns

    def _take(self, indices: np.ndarray) -> Table:
        return Table({n: c.take(indices) for n, c in self._columns.items()}, len(indices))

    def filter(self, mask: np.ndarray | Column) -> Table:
        """Rows where `mask` is true (a null in a boolean column counts as false)."""
        if isinstance(mask, Column):
            mask = np.asarray(mask.data, dtype=bool) & mask.is_valid()
        return self._take(np.flatnonzero(np.asarray(mask, dtype=bool)))

    def slice(self, offset: int = 0, length: int | None = None) -> Table:
        offset = max(0, min(int(offset), self._rows))
        end = self._rows if length is None else min(self._rows, offset + int(length))
        return self._take(np.arange(offset, end))

    def sort_by(self, keys: str | Sequence[tuple[str, str]]) -> Table:
        """Stable sort, nulls last, as pyarrow's `sort_by`."""
        if isinstance(keys, str):
            keys = [(keys, "ascending")]
        order = np.arange(self._rows)
        for name, direction in reversed(list(keys)):
            column = self._columns[name].take(order)
            valid = np.flatnonzero(column.is_valid())
            values = column.data[valid]
            if values.dtype == object:
                ranked = sorted(range(len(values)), key=values.__getitem__,
                                reverse=direction == "descending")
                step = valid[np.array(ranked, dtype=np.int64)]
            else:
                _, ranks = np.unique(values, return_inverse=True)
                step = valid[np.argsort(-ranks if direction == "descending" else ranks,
                                        kind="stable")]
            step = np.concatenate([step, np.flatnonzero(~column.is_valid())]).astype(np.int64)
            order = order[step]
        return self._take(order)

    def select(self, names: Iterable[str]) -> Table:
        return Table({n: self._columns[n] for n in names}, self._rows)

    def append_column(self, name: str, column: Column | Sequence[Any] | np.ndarray) -> Table:
        if not isinstance(column, Column):
            column = Column.from_values(column)
        return Table({**self._columns, name: column}, self._rows)

    def to_pylist(self) -> list[dict[str, Any]]:
        names = list(self._columns)
        columns = [self._columns[n].to_pylist() for n in names]
        return [dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)] \
            if names else [{} for _ in range(self._rows)]

    def to_pydict(self) -> dict[str, list[Any]]:
        return {n: c.to_pylist() for n, c in self._columns.items()}

    def __repr__(self) -> str:
        return f"Table({self._rows} rows: {', '.join(f'{n}: {c.type}' for n, c in self._columns.items())})"


def _arrow_type(type_name: str):
    import pyarrow as pa

    if is_list_type(type_name):
        return pa.list_(_arrow_type(list_value_type(type_name)))
    return pa.type_for_alias(type_name)


def as_table(table: Any) -> Table:
    """A `Table` from a `Table` or a `pyarrow.Table`."""
    return table if isinstance(table, Table) else Table.from_arrow(table)
