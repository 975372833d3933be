"""The tf.train.Example family of protobuf messages, built at run time.

TensorFlow's ``example.proto`` and ``feature.proto`` are described here as a
``FileDescriptorProto`` (field numbers and types as TensorFlow defines them),
added to a private descriptor pool and turned into message classes with
``message_factory.GetMessageClass``.  No ``protoc``, no generated code and no
TensorFlow are needed; with the upb backend the classes parse in C.

The wire schema (proto3, package ``tensorflow``)::

    BytesList     { repeated bytes value = 1; }
    FloatList     { repeated float value = 1 [packed]; }
    Int64List     { repeated int64 value = 1 [packed]; }
    Feature       { oneof kind { BytesList bytes_list = 1;
                                 FloatList float_list = 2;
                                 Int64List int64_list = 3; } }
    Features      { map<string, Feature> feature = 1; }
    FeatureList   { repeated Feature feature = 1; }
    FeatureLists  { map<string, FeatureList> feature_list = 1; }
    Example       { Features features = 1; }
    SequenceExample { Features context = 1; FeatureLists feature_lists = 2; }

``Example.features`` and ``SequenceExample.context`` share field number 1 and
type, so every record can be parsed as a ``SequenceExample``: an Example then
simply has no ``feature_lists``.  That is how the reader tells the two record
types apart without relying on a parse error.
"""

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_PACKAGE = "tensorflow"
_FDP = descriptor_pb2.FieldDescriptorProto

# Feature kinds, by their field number inside Feature's ``kind`` oneof.
KIND_BYTES, KIND_FLOAT, KIND_INT64 = 1, 2, 3
KIND_NAMES = {KIND_BYTES: "bytes", KIND_FLOAT: "float", KIND_INT64: "int64"}
KIND_LIST_FIELDS = {KIND_BYTES: "bytes_list", KIND_FLOAT: "float_list", KIND_INT64: "int64_list"}


def _field(message, name, number, kind, *, repeated=False, type_name=None, oneof=None):
    field = message.field.add(name=name, number=number, type=kind)
    field.label = _FDP.LABEL_REPEATED if repeated else _FDP.LABEL_OPTIONAL
    if type_name is not None:
        field.type_name = f".{_PACKAGE}.{type_name}"
    if oneof is not None:
        field.oneof_index = oneof


def _map(message, field_name, number, entry_name, value_type):
    """A proto3 ``map<string, value_type>``: a repeated nested entry message."""
    entry = message.nested_type.add(name=entry_name)
    entry.options.map_entry = True
    _field(entry, "key", 1, _FDP.TYPE_STRING)
    _field(entry, "value", 2, _FDP.TYPE_MESSAGE, type_name=value_type)
    _field(message, field_name, number, _FDP.TYPE_MESSAGE, repeated=True,
           type_name=f"{message.name}.{entry_name}")


def _file_descriptor():
    fdp = descriptor_pb2.FileDescriptorProto(
        name="towers_tools/tensorflow_example.proto", package=_PACKAGE, syntax="proto3")
    add = fdp.message_type.add
    # proto3 packs repeated scalars by default, as TensorFlow's [packed = true] asks.
    _field(add(name="BytesList"), "value", 1, _FDP.TYPE_BYTES, repeated=True)
    _field(add(name="FloatList"), "value", 1, _FDP.TYPE_FLOAT, repeated=True)
    _field(add(name="Int64List"), "value", 1, _FDP.TYPE_INT64, repeated=True)
    feature = add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, field_name in KIND_LIST_FIELDS.items():
        list_type = {"bytes_list": "BytesList", "float_list": "FloatList",
                     "int64_list": "Int64List"}[field_name]
        _field(feature, field_name, number, _FDP.TYPE_MESSAGE, type_name=list_type, oneof=0)
    _map(add(name="Features"), "feature", 1, "FeatureEntry", "Feature")
    _field(add(name="FeatureList"), "feature", 1, _FDP.TYPE_MESSAGE, repeated=True,
           type_name="Feature")
    _map(add(name="FeatureLists"), "feature_list", 1, "FeatureListEntry", "FeatureList")
    _field(add(name="Example"), "features", 1, _FDP.TYPE_MESSAGE, type_name="Features")
    sequence = add(name="SequenceExample")
    _field(sequence, "context", 1, _FDP.TYPE_MESSAGE, type_name="Features")
    _field(sequence, "feature_lists", 2, _FDP.TYPE_MESSAGE, type_name="FeatureLists")
    return fdp


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file_descriptor())


def _cls(name):
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


BytesList = _cls("BytesList")
FloatList = _cls("FloatList")
Int64List = _cls("Int64List")
Feature = _cls("Feature")
Features = _cls("Features")
FeatureList = _cls("FeatureList")
FeatureLists = _cls("FeatureLists")
Example = _cls("Example")
SequenceExample = _cls("SequenceExample")

# Field descriptor -> kind, for the reader's hot loop: ``Feature.ListFields()``
# returns the one set oneof member as (descriptor, value) in a single C call.
KIND_OF_FIELD = {Feature.DESCRIPTOR.fields_by_number[k]: k for k in KIND_NAMES}
