from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchemaMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEMA_MODE_UNSPECIFIED: _ClassVar[SchemaMode]
    SCHEMA_MODE_STRICT: _ClassVar[SchemaMode]
    SCHEMA_MODE_COMPLETE: _ClassVar[SchemaMode]

class Enforcement(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENFORCEMENT_UNSPECIFIED: _ClassVar[Enforcement]
    ENFORCEMENT_GRAMMAR: _ClassVar[Enforcement]
    ENFORCEMENT_REWRITTEN: _ClassVar[Enforcement]
    ENFORCEMENT_RUNTIME: _ClassVar[Enforcement]
    ENFORCEMENT_ANNOTATION: _ClassVar[Enforcement]

class AdditionalProperties(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADDITIONAL_PROPERTIES_UNSPECIFIED: _ClassVar[AdditionalProperties]
    ADDITIONAL_PROPERTIES_ALLOW: _ClassVar[AdditionalProperties]
    ADDITIONAL_PROPERTIES_FORBID: _ClassVar[AdditionalProperties]
SCHEMA_MODE_UNSPECIFIED: SchemaMode
SCHEMA_MODE_STRICT: SchemaMode
SCHEMA_MODE_COMPLETE: SchemaMode
ENFORCEMENT_UNSPECIFIED: Enforcement
ENFORCEMENT_GRAMMAR: Enforcement
ENFORCEMENT_REWRITTEN: Enforcement
ENFORCEMENT_RUNTIME: Enforcement
ENFORCEMENT_ANNOTATION: Enforcement
ADDITIONAL_PROPERTIES_UNSPECIFIED: AdditionalProperties
ADDITIONAL_PROPERTIES_ALLOW: AdditionalProperties
ADDITIONAL_PROPERTIES_FORBID: AdditionalProperties

class Constraint(_message.Message):
    __slots__ = ("json_schema", "regex", "lark", "gbnf", "choice", "json_object", "structural_tags", "json_options")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    GBNF_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAGS_FIELD_NUMBER: _ClassVar[int]
    JSON_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    lark: str
    gbnf: str
    choice: ChoiceList
    json_object: bool
    structural_tags: StructuralTags
    json_options: JsonOptions
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ..., gbnf: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., json_object: _Optional[bool] = ..., structural_tags: _Optional[_Union[StructuralTags, _Mapping]] = ..., json_options: _Optional[_Union[JsonOptions, _Mapping]] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class StructuralTags(_message.Message):
    __slots__ = ("tags", "triggers")
    TAGS_FIELD_NUMBER: _ClassVar[int]
    TRIGGERS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedCompositeFieldContainer[StructuralTag]
    triggers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[_Union[StructuralTag, _Mapping]]] = ..., triggers: _Optional[_Iterable[str]] = ...) -> None: ...

class StructuralTag(_message.Message):
    __slots__ = ("begin", "json_schema", "end")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    begin: str
    json_schema: str
    end: str
    def __init__(self, begin: _Optional[str] = ..., json_schema: _Optional[str] = ..., end: _Optional[str] = ...) -> None: ...

class JsonOptions(_message.Message):
    __slots__ = ("whitespace_flexible", "item_separator", "key_separator", "additional_properties", "coerce_one_of", "lenient", "schema_mode")
    WHITESPACE_FLEXIBLE_FIELD_NUMBER: _ClassVar[int]
    ITEM_SEPARATOR_FIELD_NUMBER: _ClassVar[int]
    KEY_SEPARATOR_FIELD_NUMBER: _ClassVar[int]
    ADDITIONAL_PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    COERCE_ONE_OF_FIELD_NUMBER: _ClassVar[int]
    LENIENT_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_MODE_FIELD_NUMBER: _ClassVar[int]
    whitespace_flexible: bool
    item_separator: str
    key_separator: str
    additional_properties: AdditionalProperties
    coerce_one_of: bool
    lenient: bool
    schema_mode: SchemaMode
    def __init__(self, whitespace_flexible: _Optional[bool] = ..., item_separator: _Optional[str] = ..., key_separator: _Optional[str] = ..., additional_properties: _Optional[_Union[AdditionalProperties, str]] = ..., coerce_one_of: _Optional[bool] = ..., lenient: _Optional[bool] = ..., schema_mode: _Optional[_Union[SchemaMode, str]] = ...) -> None: ...

class KeywordEnforcement(_message.Message):
    __slots__ = ("keyword", "location", "enforcement", "detail")
    KEYWORD_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    ENFORCEMENT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    keyword: str
    location: str
    enforcement: Enforcement
    detail: str
    def __init__(self, keyword: _Optional[str] = ..., location: _Optional[str] = ..., enforcement: _Optional[_Union[Enforcement, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class SchemaReport(_message.Message):
    __slots__ = ("mode", "grammar_keywords", "keywords", "validated", "omitted")
    MODE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_KEYWORDS_FIELD_NUMBER: _ClassVar[int]
    KEYWORDS_FIELD_NUMBER: _ClassVar[int]
    VALIDATED_FIELD_NUMBER: _ClassVar[int]
    OMITTED_FIELD_NUMBER: _ClassVar[int]
    mode: SchemaMode
    grammar_keywords: _containers.RepeatedScalarFieldContainer[str]
    keywords: _containers.RepeatedCompositeFieldContainer[KeywordEnforcement]
    validated: bool
    omitted: int
    def __init__(self, mode: _Optional[_Union[SchemaMode, str]] = ..., grammar_keywords: _Optional[_Iterable[str]] = ..., keywords: _Optional[_Iterable[_Union[KeywordEnforcement, _Mapping]]] = ..., validated: _Optional[bool] = ..., omitted: _Optional[int] = ...) -> None: ...

class TokenizerFingerprint(_message.Message):
    __slots__ = ("vocab_size", "tokens_sha256", "eos_token_ids")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SHA256_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    tokens_sha256: bytes
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, vocab_size: _Optional[int] = ..., tokens_sha256: _Optional[bytes] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
