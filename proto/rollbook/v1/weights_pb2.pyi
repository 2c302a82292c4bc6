from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightUpdateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_UPDATE_KIND_UNSPECIFIED: _ClassVar[WeightUpdateKind]
    WEIGHT_UPDATE_KIND_UP_TO_DATE: _ClassVar[WeightUpdateKind]
    WEIGHT_UPDATE_KIND_FULL: _ClassVar[WeightUpdateKind]
    WEIGHT_UPDATE_KIND_DELTA: _ClassVar[WeightUpdateKind]
WEIGHT_UPDATE_KIND_UNSPECIFIED: WeightUpdateKind
WEIGHT_UPDATE_KIND_UP_TO_DATE: WeightUpdateKind
WEIGHT_UPDATE_KIND_FULL: WeightUpdateKind
WEIGHT_UPDATE_KIND_DELTA: WeightUpdateKind

class WeightFetchRequest(_message.Message):
    __slots__ = ("have_version", "full")
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    have_version: int
    full: bool
    def __init__(self, have_version: _Optional[int] = ..., full: _Optional[bool] = ...) -> None: ...

class WeightTensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ...) -> None: ...

class WeightHeader(_message.Message):
    __slots__ = ("kind", "version", "base_version", "checksum", "layout", "flat_bytes", "payload_bytes", "num_changed", "index_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FLAT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHANGED_FIELD_NUMBER: _ClassVar[int]
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: WeightUpdateKind
    version: int
    base_version: int
    checksum: bytes
    layout: _containers.RepeatedCompositeFieldContainer[WeightTensorSpec]
    flat_bytes: int
    payload_bytes: int
    num_changed: int
    index_bytes: int
    def __init__(self, kind: _Optional[_Union[WeightUpdateKind, str]] = ..., version: _Optional[int] = ..., base_version: _Optional[int] = ..., checksum: _Optional[bytes] = ..., layout: _Optional[_Iterable[_Union[WeightTensorSpec, _Mapping]]] = ..., flat_bytes: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., num_changed: _Optional[int] = ..., index_bytes: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
